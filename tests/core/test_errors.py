"""Error mapping, the cuda-bindings adaptation layer, the fork guard and no-driver paths."""

from __future__ import annotations

import multiprocessing as mp

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


@pytest.mark.parametrize("major", [12, 13])
def test_prefetch_and_advise_reach_the_driver_in_each_bindings_form(gpu, monkeypatch, major):
    """13.x takes a ``CUmemLocation``, 12.x a device ordinal (-1: the host); the fake
    takes only the form of the major it plays (test_context_fake checks cuCtxCreate)."""
    monkeypatch.setattr(_driver, "BINDINGS_VERSION", (major, 9))
    gpu.bindings_major = major
    advice = gpu.CUmem_advise.CU_MEM_ADVISE_SET_PREFERRED_LOCATION
    with ck.registry.context(0):
        m = ck.ManagedBuffer(4096)
        _driver.mem_prefetch(m.ptr, 4096, 1, 0)
        _driver.mem_prefetch(m.ptr, 4096, "cpu", 0)
        _driver.mem_advise(m.ptr, 4096, advice, "cpu")
        _driver.mem_advise(m.ptr, 4096, advice, 0)
    assert gpu.prefetches == [(m.ptr, 4096, 1), (m.ptr, 4096, "cpu")]
    assert gpu.advice == [(m.ptr, 4096, advice, "cpu"), (m.ptr, 4096, advice, 0)]


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
