"""The bad-input corpus machinery shared by tests/core/test_bad_input_gpu.py and
tests/core/test_bad_input_launch_gpu.py: the environment the cases share, the case
registry, and the check that the process still computes after every case.

Each case names the exception class and the key phrases its message must hold; after it
a normal ``vector_add`` launch must still compute the right answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source
from ctxkit.context import Context

N = 1000

WIDTHS_SOURCE = """
__global__ void widths(unsigned char u8, short s16, int s32, unsigned long long u64,
                       long long s64, float* out, size_t n)
{
    if (n) out[0] = u8 + s16 + s32 + (float)u64 + (float)s64;
}
"""


class Env:
    """What the cases share: device 0's context, an owned context, kernels, buffers."""

    def __init__(self) -> None:
        self.ctx0 = ck.registry.context(0)
        self.owned = Context.create(0)
        with self.ctx0:
            self.vadd_obj = ck.compile(kernel_source("vector_add.cu"), name="vector_add.cu")
            self.vadd_module = ck.Module.load(self.vadd_obj)
            self.vadd = self.vadd_module.function("vector_add")
            self.scale = ck.Module.load(
                ck.compile(kernel_source("scale.cu"), name="scale.cu")
            ).function("scale_f32")
            self.a, self.b, self.c = (ck.DeviceBuffer(N * 4) for _ in range(3))
            widths = ck.compile(WIDTHS_SOURCE, name="widths.cu", name_expressions=("widths",))
            self.widths = ck.Module.load(widths).function("widths")


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.owned.close()


@pytest.fixture(autouse=True)
def still_works(env: Env) -> Iterator[None]:
    """After every case a normal launch must still compute the right answer."""
    yield
    rng = np.random.default_rng()
    x, y = rng.random(N, dtype=np.float32), rng.random(N, dtype=np.float32)
    with ck.bind(0):
        a, b, c = (ck.DeviceBuffer(N * 4) for _ in range(3))
        a.copy_from_host(x)
        b.copy_from_host(y)
        env.vadd.launch(4, 256, a, b, c, N)
        got = c.copy_to_host(np.empty(N, np.float32))
        for buf in (a, b, c):
            buf.close()
    assert np.array_equal(got, x + y), "the process no longer computes after the case"


@dataclass(frozen=True)
class Case:
    fn: Callable[[Env], Any]
    exc: type[BaseException]
    phrases: tuple[str, ...]
    devices: int


def in_thread(fn: Callable[[], Any], name: str = "case-thread") -> None:
    """Run *fn* in a fresh thread (no context current) and re-raise what it raised."""
    box: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    if box:
        raise box[0]


def vadd_args(env: Env) -> tuple[Any, ...]:
    return env.a, env.b, env.c, N


def make_registry() -> tuple[dict[str, Case], Callable[..., Any]]:
    """A case registry and its ``@case(exc, *phrases, devices=1)`` decorator."""
    cases: dict[str, Case] = {}

    def case(exc: type[BaseException], *phrases: str, devices: int = 1) -> Callable[..., Any]:
        def register(fn: Callable[[Env], Any]) -> Callable[[Env], Any]:
            cases[fn.__name__] = Case(fn, exc, phrases, devices)
            return fn

        return register

    return cases, case


def run_case(name: str, c: Case, env: Env) -> None:
    """Run one case with device 0 bound; check the exception type and its phrases."""
    if ck.device_count() < c.devices:
        pytest.skip(f"needs {c.devices} devices")
    with ck.bind(0):
        with pytest.raises(c.exc) as info:
            c.fn(env)
    message = str(info.value)
    for phrase in c.phrases:
        assert phrase in message, f"{name}: {phrase!r} is not in the message:\n{message}"
