"""Error mapping, the cuda-bindings adaptation layer, the fork guard and no-driver paths."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import pytest

import ctxkit as ck
from ctxkit import _driver, errors


@pytest.mark.parametrize(
    ("code", "cls", "hint"),
    [
        (2, ck.OutOfMemoryError, "free buffers"),
        (201, ck.NoCurrentContextError, "ctxkit.bind"),
        (709, ck.ContextClosedError, "destroyed"),
        (216, ck.ContextInUseError, "registry"),
        (34, ck.DriverNotFoundError, "stub"),
        (36, ck.DriverNotFoundError, "upgrade the driver"),
        (700, ck.ContextPoisonedError, "poisoned"),
        (714, ck.ContextPoisonedError, "compute-sanitizer"),
        (715, ck.ContextPoisonedError, "poisoned"),
        (716, ck.ContextPoisonedError, "poisoned"),
        (719, ck.ContextPoisonedError, "poisoned"),
        (222, ck.CudaError, "target='cubin'"),
        (209, ck.CudaError, "arch"),
        (500, ck.CudaError, "extern"),
        (400, ck.CudaError, "another context"),
        (1, ck.CudaError, ""),
    ],
)
def test_error_mapping(code, cls, hint):
    exc = _driver.from_result(code, "cuSomething(x=1)", detail="extra detail")
    assert type(exc) is cls
    assert exc.code == code
    msg = str(exc)
    assert msg.startswith("cuSomething(x=1) failed: ")
    assert (exc.name in msg and exc.name.startswith("CUDA_ERROR")) or code == 1
    assert hint in msg
    assert "extra detail" in msg
    assert isinstance(exc, ck.CudaError)


def test_error_names_come_from_bindings():
    exc = _driver.from_result(201)
    assert exc.name == "CUDA_ERROR_INVALID_CONTEXT"
    assert str(exc).startswith("CUDA_ERROR_INVALID_CONTEXT")


def test_unknown_code_still_describes():
    exc = _driver.from_result(123456)
    assert type(exc) is ck.CudaError and "123456" in str(exc)


def test_special_bases():
    assert issubclass(ck.OutOfMemoryError, MemoryError)
    assert issubclass(ck.LaunchArgumentError, TypeError)
    e = ck.CompileError("bad", log="line 3: error")
    assert e.log == "line 3: error" and isinstance(e, ck.CudaError)


def test_every_sticky_code_is_poisoned_class():
    for code in errors.STICKY_CODES:
        assert errors.error_class_for(code) is ck.ContextPoisonedError


def test_parse_version():
    assert _driver.parse_version("13.3.0") == (13, 3)
    assert _driver.parse_version("12.9.1rc2") == (12, 9)
    assert _driver.parse_version("13") == (13, 0)
    assert _driver.BINDINGS_VERSION[0] in (12, 13)


def test_ctx_create_args_by_bindings_major():
    assert _driver.ctx_create_args(13, 4, "dev") == (None, 4, "dev")
    assert _driver.ctx_create_args(12, 4, "dev") == (4, "dev")


def test_mem_location_forms():
    assert _driver.uses_mem_location(13) and not _driver.uses_mem_location(12)
    loc = _driver.mem_location(1)
    assert loc.id == 1
    assert loc.type == _driver.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    host = _driver.mem_location("cpu")
    assert host.type == _driver.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST


def test_call_unpacks_and_raises():
    assert _driver.call(lambda: (0,)) is None
    assert _driver.call(lambda: (0, 5)) == 5
    assert _driver.call(lambda: (0, 5, 6)) == (5, 6)

    def cuMemAlloc() -> tuple[int, int]:
        return (2, 0)

    with pytest.raises(ck.OutOfMemoryError, match="cuMemAlloc"):
        _driver.call(cuMemAlloc)
    with pytest.raises(ck.NoCurrentContextError, match="my call"):
        _driver.raise_for(201, "my call")
    _driver.raise_for(0, "fine")


def test_no_driver_here_means_zero_devices():
    # CI and developer machines have no libcuda: the documented behaviour
    if _driver.driver_version() is not None:
        pytest.skip("a driver is present")
    assert ck.device_count() == 0
    assert ck.devices() == []
    with pytest.raises(ck.DriverNotFoundError, match="driver"):
        ck.Device(0)
    with pytest.raises(ck.DriverNotFoundError):
        ck.Context.primary(0)


def test_device_rejects_bad_types(fake_driver):
    with pytest.raises(TypeError, match="int"):
        ck.Device("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ck.Device(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0\.\.1"):
        ck.Device(2)
    assert ck.Device(1) is ck.Device(1) and int(ck.Device(1)) == 1
    assert ck.device_count() == 2 and len(ck.devices()) == 2


def _child_uses_cuda(q) -> None:  # runs in a forked child
    import time

    t0 = time.perf_counter()
    try:
        ck.device_count()
        q.put(("no error", 0.0))
    except ck.ForkError as exc:
        q.put((str(exc), time.perf_counter() - t0))
    except Exception as exc:  # pragma: no cover - reported to the parent
        q.put((repr(exc), 0.0))


def test_fork_after_init_raises_fork_error(fake_driver):
    _driver.init()  # the parent initialised CUDA (fake driver)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_uses_cuda, args=(q,))
    p.start()
    msg, took = q.get(timeout=10)
    p.join(10)
    assert "forked" in msg and "spawn" in msg, msg
    assert took < 1.0


def test_fork_mapping_of_not_initialized(monkeypatch):
    monkeypatch.setattr(_driver, "_parent_initialized_pid", 1234)
    exc = _driver.from_result(3, "cuCtxPushCurrent")
    assert isinstance(exc, ck.ForkError) and "1234" in str(exc)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    assert not isinstance(_driver.from_result(3, "x"), ck.ForkError)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ctxkit", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("cmd", [["info"], ["demo"], ["bench"]])
def test_cli_without_gpu_exits_2_with_message(cmd):
    if ck.device_count() > 0:
        pytest.skip("a GPU is present")
    res = _run_cli(*cmd)
    assert res.returncode == 2, res.stderr
    assert "no GPU" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_info_prints_versions_without_driver():
    if ck.device_count() > 0:
        pytest.skip("a GPU is present")
    res = _run_cli("info")
    assert "cuda-bindings" in res.stdout and "NVRTC" in res.stdout
    assert "compatibility" in res.stdout


def test_compatibility_line():
    from ctxkit.cli.info import compatibility_line

    assert "will NOT load" in compatibility_line((13, 5), (13, 0))
    assert "both load" in compatibility_line((13, 0), (13, 0))
    assert "older" in compatibility_line((12, 9), (13, 0))
    assert "--arch" in compatibility_line((13, 0), None)
    assert "install" in compatibility_line(None, (13, 0))


def test_info_with_fake_driver(fake_driver, monkeypatch, capsys):
    from ctxkit.cli import info

    monkeypatch.setattr(info, "print_info", info.print_info)
    # A fake machine with two GPUs: names/attributes come from the fake's device API
    from ctxkit.device import Device

    monkeypatch.setattr(Device, "name", property(lambda self: f"Fake GPU {self.ordinal}"))
    monkeypatch.setattr(Device, "compute_capability", property(lambda self: (9, 0)))
    monkeypatch.setattr(Device, "total_memory", property(lambda self: 141 << 30))
    monkeypatch.setattr(Device, "multiprocessor_count", property(lambda self: 132))
    monkeypatch.setattr(Device, "pci_bus_id", property(lambda self: f"0000:0{self.ordinal}:00.0"))
    monkeypatch.setattr(Device, "can_access_peer", lambda self, other: True)
    assert info.print_info() == 0
    out = capsys.readouterr().out
    assert "Fake GPU 1" in out and "peer access" in out and "yes" in out
    assert "devices       : 2" in out


def test_enum_member_resolves_readable_names_and_suggests():
    d = _driver.drv
    dev_attr = d.CUdevice_attribute
    assert (
        _driver.enum_member(dev_attr, "CU_DEVICE_ATTRIBUTE_", "warp_size", "device attribute")
        == dev_attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE
    )
    assert (
        _driver.enum_member(dev_attr, "CU_DEVICE_ATTRIBUTE_", "CU_DEVICE_ATTRIBUTE_WARP_SIZE", "x")
        == dev_attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE
    )
    member = dev_attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE
    assert _driver.enum_member(dev_attr, "CU_DEVICE_ATTRIBUTE_", member, "x") is member
    with pytest.raises(ValueError, match=r"attribute 'warp'; did you mean .*warp_size"):
        _driver.enum_member(dev_attr, "CU_DEVICE_ATTRIBUTE_", "warp", "device attribute")
    with pytest.raises(ValueError, match="known: "):
        _driver.enum_member(dev_attr, "CU_DEVICE_ATTRIBUTE_", "zzzz", "device attribute")
