"""Bad-input corpus, compiler/module/launch part: each mistake raises the documented typed
error with an actionable message before anything runs on the GPU, and a normal launch still
computes the right answer after every case (tests/core/badinput.py).

Cases cover NVRTC and module loading, argument checking (counts, kinds, integer ranges
and signs of every width, buffers of another device), launch configurations, cooperative
grids and thread-block clusters.
"""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source
from ctxkit.module import KernelNotFoundError
from ctxkit.module.kernel import LaunchConfig
from tests.core.badinput import (  # noqa: F401
    Env,
    N,
    env,
    make_registry,
    run_case,
    still_works,
    vadd_args,
)

BAD_PTX = """
.version 7.0
.target sm_52
.address_size 64

.visible .entry broken(.param .u64 p)
{
    bogus.instruction.that.does.not.exist %r1;
    ret;
}
"""

CASES, case = make_registry()


# --- compiler and modules --------------------------------------------------------------------


@case(ck.CompileError, "NVRTC failed to compile", "undefined_name", "line")
def compile_bad_source(env: Env) -> None:
    src = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }'
    try:
        ck.compile(src, name="bad.cu", cache=False)
    except ck.CompileError as exc:
        assert "undefined_name" in exc.log, "CompileError.log lacks the NVRTC log"
        raise


@case(ck.CompileError, "NVRTC failed to compile", "--no-such-option")
def compile_bad_option(env: Env) -> None:
    ck.compile(kernel_source("vector_add.cu"), options=("--no-such-option",), cache=False)


@case(TypeError, "source must be str or bytes")
def compile_wrong_type(env: Env) -> None:
    ck.compile(123)  # type: ignore[arg-type]


@case(ValueError, "target must be one of")
def compile_bad_target(env: Env) -> None:
    ck.compile(kernel_source("vector_add.cu"), target="elf")


@case(ValueError, "cannot understand arch")
def compile_bad_arch(env: Env) -> None:
    ck.compile(kernel_source("vector_add.cu"), arch="banana")


@case(TypeError, "not a single string")
def compile_options_as_one_string(env: Env) -> None:
    ck.compile(kernel_source("vector_add.cu"), options="-lineinfo")  # type: ignore[arg-type]


@case(ValueError, "not PTX")
def load_garbage_bytes(env: Env) -> None:
    ck.Module.load(b"\x00 this is not device code")


@case(ck.CompileError, "PTX")
def load_bad_ptx(env: Env) -> None:
    kernel = ck.Module.load(BAD_PTX).function("broken")
    kernel.launch(1, 1, env.a)
    env.ctx0.synchronize()


@case(KernelNotFoundError, "Kernels present: vector_add", "Did you mean 'vector_add'")
def wrong_kernel_name(env: Env) -> None:
    env.vadd_module.function("vector_ad")


@case(KernelNotFoundError, "mangled", 'extern "C"')
def mangled_kernel_name(env: Env) -> None:
    obj = ck.compile("__global__ void plain(float* x) { x[0] = 1.0f; }", name="plain.cu")
    ck.Module.load(obj).function("plain")


@case(FileNotFoundError, "neither a file nor PTX")
def load_missing_file(env: Env) -> None:
    ck.Module.load("/no/such/kernel.cubin")


@case(TypeError, "Module.load takes")
def load_wrong_type(env: Env) -> None:
    ck.Module.load(12345)


# --- launches --------------------------------------------------------------------------------


@case(ck.LaunchArgumentError, "takes 4 arguments but 2 were given", "Signature")
def launch_too_few_arguments(env: Env) -> None:
    env.vadd.launch(4, 256, env.a, env.b)


@case(ck.LaunchArgumentError, "argument 0", "a float for an integer parameter")
def launch_float_for_pointer(env: Env) -> None:
    env.vadd.launch(4, 256, 1.5, env.b, env.c, N)


@case(ck.LaunchArgumentError, "pageable host memory", "pinned_empty")
def launch_with_host_array(env: Env) -> None:
    env.vadd.launch(4, 256, np.zeros(N, np.float32), env.b, env.c, N)


@case(ck.LaunchArgumentError, "argument 3", "a float for an integer parameter")
def launch_float_for_size(env: Env) -> None:
    env.vadd.launch(4, 256, env.a, env.b, env.c, 3.5)


@case(ck.CudaError, "2048 threads", "1024")
def launch_block_too_large(env: Env) -> None:
    env.vadd.launch(1, 2048, *vadd_args(env))


@case(ValueError, "positive")
def launch_empty_grid(env: Env) -> None:
    env.vadd.launch(0, 256, *vadd_args(env))


@case(ck.CudaError, "shared_mem=1048576")
def launch_too_much_shared_memory(env: Env) -> None:
    env.vadd.launch(1, 32, *vadd_args(env), shared_mem=1 << 20)


@case(ck.CudaError, "belongs to", "with stream.context")
def launch_on_stream_of_other_context(env: Env) -> None:
    env.vadd.launch(4, 256, *vadd_args(env), stream=ck.Stream(env.owned))


@case(ck.CudaError, "bound to", "ctxkit.bind")
def bound_module_launched_in_other_context(env: Env) -> None:
    mod = ck.Module.load(env.vadd_obj, context=env.owned)
    mod.function("vector_add").launch(4, 256, *vadd_args(env))


@case(ck.CudaError, "is closed", "load it again")
def launch_from_closed_module(env: Env) -> None:
    mod = ck.Module.load(env.vadd_obj)
    kernel = mod.function("vector_add")
    mod.close()
    kernel.launch(4, 256, *vadd_args(env))


# --- integer ranges and signs (issue 14: they would fault or corrupt) ---------------------


def widths_args(env: Env, **given: object) -> tuple[object, ...]:
    values: dict[str, object] = {"u8": 1, "s16": 1, "s32": 1, "u64": 1, "s64": 1}
    values.update(given)
    return (*values.values(), env.c, N)


@case(ck.LaunchArgumentError, "argument 3", "negative value for an unsigned parameter", "vector_")
def launch_negative_size_t(env: Env) -> None:
    if not env.vadd.params[3].unsigned:  # the source of an extern "C" kernel is not kept
        pytest.skip("this ctxkit.compile does not keep the source: size_t is not known")
    env.vadd.launch(4, 256, env.a, env.b, env.c, -1)


@case(ck.LaunchArgumentError, "argument 6", "negative value", "unsigned long")
def launch_negative_numpy_size_t(env: Env) -> None:
    pytest.importorskip("cxxfilt", reason="C++ kernels' types need the extra: the demangle extra")
    env.widths.launch(1, 1, *widths_args(env)[:6], np.int64(-5))


@case(ck.LaunchArgumentError, "argument 0", "out of range for .u8", "valid: 0..255")
def launch_u8_out_of_range(env: Env) -> None:
    env.widths.launch(1, 1, *widths_args(env, u8=256))


@case(ck.LaunchArgumentError, "argument 0", "negative value", "unsigned char")
def launch_u8_negative(env: Env) -> None:
    pytest.importorskip("cxxfilt", reason="C++ kernels' types need the extra: the demangle extra")
    env.widths.launch(1, 1, *widths_args(env, u8=-1))


@case(ck.LaunchArgumentError, "argument 1", "valid: -32768..32767")
def launch_s16_out_of_range(env: Env) -> None:
    env.widths.launch(1, 1, *widths_args(env, s16=40000))


@case(ck.LaunchArgumentError, "argument 2", "valid: -2147483648..2147483647")
def launch_int_out_of_range(env: Env) -> None:
    env.widths.launch(1, 1, *widths_args(env, s32=2**31))


@case(ck.LaunchArgumentError, "argument 3", "negative value", "18446744073709551615")
def launch_u64_negative(env: Env) -> None:
    env.widths.launch(1, 1, *widths_args(env, u64=-1))


@case(ck.LaunchArgumentError, "argument 4", "out of range", "9223372036854775807")
def launch_s64_out_of_range(env: Env) -> None:
    env.widths.launch(1, 1, *widths_args(env, s64=2**63))


@case(ck.LaunchArgumentError, "argument 3", "negative value")
def prepared_set_arg_negative(env: Env) -> None:
    pl = env.widths.prepare(1, 1, *widths_args(env))
    pl.set_arg(3, -7)


# --- buffers of another device ------------------------------------------------------------


@case(ck.LaunchArgumentError, "on device 1", "launches on device 0", "enable_peer_access",
      devices=2)  # fmt: skip
def launch_with_buffer_of_another_device(env: Env) -> None:
    other = ck.Context.create(1)  # a fresh context: no peer access was ever enabled to it
    far = ck.DeviceBuffer(N * 4, other)
    try:
        env.vadd.launch(4, 256, env.a, env.b, far, N)
    finally:
        far.close()
        other.close()


# --- cooperative grids and clusters ---------------------------------------------------------


@case(ck.CudaError, "cooperative launch", "at most", "SMs", "grid-stride")
def cooperative_grid_too_large(env: Env) -> None:
    sms = ck.Device(0).multiprocessor_count
    blocks = env.vadd.occupancy(256) * sms + 1
    env.vadd.launch(blocks, 256, *vadd_args(env), cooperative=True)


def _needs_clusters() -> None:
    if ck.Device(0).compute_capability < (9, 0):
        pytest.skip("thread-block clusters need compute capability 9.0")


@case(ck.CudaError, "not a multiple of 4", "round the grid up to (8, 1, 1)")
def cluster_not_dividing_the_grid(env: Env) -> None:
    _needs_clusters()
    env.vadd.launch(6, 256, *vadd_args(env), cluster=4)


@case(ck.CudaError, "cluster=(16, 1, 1)", "non_portable_cluster_size_allowed")
def cluster_above_the_portable_size(env: Env) -> None:
    _needs_clusters()
    env.vadd.launch(16, 64, *vadd_args(env), cluster=16)


@case(TypeError, "not both")
def launch_config_and_keywords(env: Env) -> None:
    env.vadd.launch(4, 256, *vadd_args(env), config=LaunchConfig(cooperative=True), cluster=2)


# --- the runner ----------------------------------------------------------------------------


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 35


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name: str, env: Env) -> None:
    run_case(name, CASES[name], env)
