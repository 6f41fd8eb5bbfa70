"""Kernel argument checking and packing, and launch-configuration checks (no driver).

:class:`ArgPacker` checks Python arguments against a kernel's parameter list (see
:mod:`ctxkit.module.ptxsig`) and packs them, at the device-side offsets, into one buffer plus
the ``void**`` array ``cuLaunchKernel`` takes. PTX does not mark pointers reliably
(NVRTC emits ``.u64`` for both ``float*`` and ``size_t``), so a 64-bit integer
parameter takes a device pointer or an integer, while floats and narrower integers
refuse pointers. :func:`normalize_dims` and :func:`explain_launch_config` check and
explain grid/block/shared-memory settings.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import LaunchArgumentError
from .pointers import (
    Refused,
    getters,
    pointer_getter,
    short_repr,
)
from .ptxsig import (
    BITS,
    BYTES,
    FLOAT,
    INT,
    Param,
    Signature,
)

__all__ = ["ArgPacker", "ParamBuffer", "explain_launch_config", "normalize_dims"]


def _int_range(p: Param) -> tuple[int, int]:
    bits = p.size * 8
    if p.signed:
        return -(1 << (bits - 1)), 1 << (bits - 1)
    return -(1 << (bits - 1)), 1 << bits


def _as_int(p: Param, v: Any) -> int:
    t = type(v)
    if t is int or t is bool or isinstance(v, (np.integer, np.bool_)):
        return int(v)
    if t is float or isinstance(v, np.floating):
        raise Refused(
            f"got {short_repr(v)}: a float for an integer parameter; convert it explicitly "
            "(int(x)) if truncation is intended"
        )
    if v is None and p.accepts_pointer:
        return 0
    g = pointer_getter(v)
    if g is not None:
        if p.accepts_pointer:
            return g(v)
        if isinstance(v, np.ndarray):
            raise Refused(
                f"got a numpy array {v.shape} {v.dtype}; the parameter takes one integer "
                "(use arr.item() or a numpy scalar)"
            )
        raise Refused(
            f"got {type(v).__name__} (device memory), but a {p.size * 8}-bit integer cannot "
            "hold a pointer; the kernel expects a number here (check the argument order)"
        )
    expected = "an integer or a device pointer" if p.accepts_pointer else "an integer"
    raise Refused(f"got {short_repr(v)}; expected {expected}")


_MISSING: Any = object()


def _int_converter(p: Param) -> Callable[[Any], int]:
    lo, hi = _int_range(p)
    mask = (1 << (p.size * 8)) - 1
    signed = p.signed
    known = getters if p.accepts_pointer else {}

    def conv(v: Any) -> int:
        if type(v) is int:
            x = v
        else:
            g = known.get(type(v), _MISSING)
            if g is not None and g is not _MISSING:
                return g(v)
            x = _as_int(p, v)
        if not lo <= x < hi:
            raise Refused(f"got {x}, out of range for .{p.type} (valid: {lo}..{hi - 1})")
        return x if signed else x & mask

    return conv


_FLOAT_MAX = {2: 65504.0, 4: 3.4028234663852886e38, 8: float("inf")}


_INF = float("inf")


def _float_converter(p: Param) -> Callable[[Any], float]:
    limit = _FLOAT_MAX[p.size]

    def conv(v: Any) -> float:
        t = type(v)
        if t is float or t is int or t is bool or isinstance(v, (np.floating, np.integer)):
            try:
                x = float(v)
            except OverflowError:
                raise Refused(f"got {short_repr(v)}, too large for .{p.type}") from None
        elif isinstance(v, np.ndarray):
            raise Refused(
                f"got a numpy array {v.shape} {v.dtype}; a float parameter takes one number "
                "(use arr.item() or a numpy scalar)"
            )
        elif v is None or pointer_getter(v) is not None:
            raise Refused(
                f"got {type(v).__name__}, a pointer, but the kernel expects a floating-point "
                "number here (check the argument order)"
            )
        else:
            raise Refused(f"got {short_repr(v)}; expected a real number")
        if limit < abs(x) < _INF:
            raise Refused(f"got {x!r}, out of range for .{p.type} (max {limit:g})")
        return x

    return conv


def _to_bytes(p: Param, v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
    elif isinstance(v, (np.generic, np.ndarray)):
        if isinstance(v, np.ndarray) and not (v.flags.c_contiguous or v.flags.f_contiguous):
            raise Refused(f"got a non-contiguous array {v.shape} {v.dtype}")
        data = v.tobytes()
    elif isinstance(v, (ctypes.Structure, ctypes.Union, ctypes.Array, ctypes._SimpleCData)):
        data = bytes(memoryview(v).cast("B"))
    else:
        hint = ""
        if p.size == 2 and isinstance(v, float):
            hint = " (for a __half parameter pass np.float16(x))"
        elif p.count or p.kind == BYTES:
            hint = (
                " (a struct/array by value: pass a numpy structured scalar, "
                "np.array([...], dtype), a ctypes.Structure or bytes)"
            )
        raise Refused(f"got {short_repr(v)}; expected exactly {p.size} bytes{hint}")
    if len(data) != p.size:
        raise Refused(f"got {len(data)} bytes ({type(v).__name__}); it takes {p.size} bytes")
    return data


def _bytes_converter(p: Param) -> Callable[[Any], bytes]:
    return lambda v: _to_bytes(p, v)


def _bits_converter(p: Param) -> Callable[[Any], int]:
    as_int = _int_converter(p)

    def conv(v: Any) -> int:
        t = type(v)
        if t is int:
            return as_int(v)
        if isinstance(v, np.generic) and not isinstance(v, (np.integer, np.bool_)):
            return int.from_bytes(_to_bytes(p, v), "little")
        if t is float:
            raise Refused(
                f"got {short_repr(v)}, but the parameter type is {p.ptx_type}, which does not "
                f"say int or float; pass a numpy scalar of {p.size} bytes "
                f"(np.float{p.size * 8}(x) or np.int{p.size * 8}(x))"
            )
        if isinstance(v, (bytes, bytearray, memoryview, ctypes._SimpleCData)):
            return int.from_bytes(_to_bytes(p, v), "little")
        return as_int(v)

    return conv


def _converter(p: Param) -> Callable[[Any], Any]:
    if p.kind == INT:
        return _int_converter(p)
    if p.kind == FLOAT:
        return _float_converter(p)
    if p.kind == BITS:
        return _bits_converter(p)
    return _bytes_converter(p)


def _compile_fill(convs: Sequence[Callable[[Any], Any]], pack_into: Any) -> Any:
    """``fill(data, args)``: convert and pack all arguments with one unrolled call.

    Generated so the hot path has no per-argument loop (about half the cost of a
    comprehension); the source contains only generated names, never user input.
    """
    calls = ", ".join(f"c{i}(a[{i}])" for i in range(len(convs)))
    namespace: dict[str, Any] = {f"c{i}": c for i, c in enumerate(convs)}
    namespace["pack_into"] = pack_into
    exec(f"def fill(d, a):\n    pack_into(d, 0, {calls})\n", namespace)
    return namespace["fill"]


def _layout_format(params: Sequence[Param], total: int) -> str:
    fmt = ["<"]
    pos = 0
    for p in params:
        if p.offset > pos:
            fmt.append(f"{p.offset - pos}x")
        fmt.append(p.code)
        pos = p.offset + p.size
    if total > pos:
        fmt.append(f"{total - pos}x")
    return "".join(fmt)


class ParamBuffer:
    """Stable memory for one launch's parameters: ``data`` plus the ``void**`` array.

    ``address`` is what ``cuLaunchKernel`` takes as ``kernelParams`` (0 for a kernel
    with no parameters).
    """

    __slots__ = ("address", "data", "pointers")

    def __init__(self, sig: Signature) -> None:
        self.data = (ctypes.c_char * max(sig.size, 1))()
        base = ctypes.addressof(self.data)
        n = len(sig.params)
        self.pointers = (ctypes.c_void_p * max(n, 1))(*(base + p.offset for p in sig.params))
        self.address = ctypes.addressof(self.pointers) if n else 0

    def __bytes__(self) -> bytes:
        return bytes(self.data)


class ArgPacker:
    """Checks and packs arguments for one kernel signature.

    Parameters
    ----------
    sig : Signature
    kernel : str
        Name used in error messages.
    """

    __slots__ = ("_convs", "_fill", "_local", "_n", "_one", "_struct", "kernel", "sig")

    def __init__(self, sig: Signature, kernel: str | None = None) -> None:
        self.sig = sig
        self.kernel = kernel or sig.name
        self._n = len(sig.params)
        self._convs = tuple(_converter(p) for p in sig.params)
        self._struct = struct.Struct(_layout_format(sig.params, sig.size))
        self._one = tuple(struct.Struct("<" + p.code) for p in sig.params)
        self._fill = _compile_fill(self._convs, self._struct.pack_into)
        self._local = threading.local()

    # -- checking --------------------------------------------------------------------

    def values(self, args: Sequence[Any]) -> list[Any]:
        """Check *args* and convert each to the value that gets packed.

        Raises
        ------
        LaunchArgumentError
            Wrong count, or an argument that does not fit its parameter (the message
            names the parameter: index, PTX name and type).
        """
        if len(args) != self._n:
            raise self._count_error(args)
        return [self._check_one(i, v) for i, v in enumerate(args)]

    def _check_one(self, i: int, v: Any) -> Any:
        p = self.sig.params[i]
        try:
            x = self._convs[i](v)
            self._one[i].pack(x)
        except Refused as exc:
            raise self._arg_error(p, str(exc)) from None
        except LaunchArgumentError as exc:
            raise self._arg_error(p, str(exc)) from None
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise self._arg_error(p, f"got {short_repr(v)}: {exc}") from None
        return x

    def _arg_error(self, p: Param, why: str) -> LaunchArgumentError:
        return LaunchArgumentError(
            f"{self.kernel}: argument {p.index} does not fit {p.describe()}: {why}. "
            f"Signature: {self._signature_text()}"
        )

    def _signature_text(self) -> str:
        inner = ", ".join(f"{p.ptx_type} {p.name}" for p in self.sig.params)
        return f"{self.kernel}({inner})"

    def _count_error(self, args: Sequence[Any]) -> LaunchArgumentError:
        given = ", ".join(type(a).__name__ for a in args) or "none"
        return LaunchArgumentError(
            f"{self.kernel} takes {self._n} argument{'s' if self._n != 1 else ''} but "
            f"{len(args)} were given ({given}). Signature: {self._signature_text()}"
        )

    def _explain(self, args: Sequence[Any], exc: BaseException) -> LaunchArgumentError:
        if len(args) != self._n:
            return self._count_error(args)
        for i, v in enumerate(args):
            try:
                self._check_one(i, v)
            except LaunchArgumentError as err:
                return err
        return LaunchArgumentError(f"{self.kernel}: cannot pack the arguments: {exc}")

    # -- packing ---------------------------------------------------------------------

    def pack(self, args: Sequence[Any]) -> bytes:
        """The device-side parameter buffer for *args* (padding bytes are zero)."""
        buf = ParamBuffer(self.sig)
        self.pack_into(buf, args)
        return bytes(buf)

    def pack_into(self, buf: ParamBuffer, args: Sequence[Any]) -> None:
        """Check *args* and write them into *buf*."""
        if len(args) != self._n:
            raise self._count_error(args)
        try:
            self._fill(buf.data, args)
        except Exception as exc:
            raise self._explain(args, exc) from None

    def pack_one(self, buf: ParamBuffer, index: int, value: Any) -> None:
        """Check and write the argument of parameter *index* only."""
        x = self._check_one(index, value)
        self._one[index].pack_into(buf.data, self.sig.params[index].offset, x)

    def address_for(self, args: Sequence[Any]) -> int:
        """Pack *args* into this thread's reusable buffer; return its ``void**`` address.

        The buffer is reused by the next call in the same thread, which is safe because
        ``cuLaunchKernel`` copies the parameters before it returns.
        """
        if len(args) != self._n:
            raise self._count_error(args)
        if not self._n:
            return 0
        try:
            buf = self._local.buf
        except AttributeError:
            buf = self._local.buf = ParamBuffer(self.sig)
        try:
            self._fill(buf.data, args)
        except Exception as exc:
            raise self._explain(args, exc) from None
        return buf.address

    def index_of(self, key: int | str) -> int:
        """Parameter index for an index or a PTX parameter name."""
        if isinstance(key, str):
            for p in self.sig.params:
                if p.name == key:
                    return p.index
            names = [p.name for p in self.sig.params]
            raise KeyError(f"{self.kernel} has no parameter {key!r} (parameters: {names})")
        i = operator.index(key)
        if not -self._n <= i < self._n:
            raise IndexError(f"{self.kernel} has {self._n} parameters; index {i} is out of range")
        return i % self._n


_DIM_MAX = (1 << 32) - 1


def normalize_dims(value: Any, what: str) -> tuple[int, int, int]:
    """``grid``/``block`` as an int or 1-3 ints -> ``(x, y, z)``, each at least 1."""
    if type(value) is int and 0 < value <= _DIM_MAX:
        return value, 1, 1
    try:
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        dims = [operator.index(d) for d in items]
    except TypeError:
        raise TypeError(
            f"{what} must be an int or a tuple of 1-3 ints, got {short_repr(value)}"
        ) from None
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(dims)}: {tuple(dims)}")
    if any(not 0 < d <= _DIM_MAX for d in dims):
        raise ValueError(f"{what} dimensions must be positive ints, got {tuple(dims)}")
    while len(dims) < 3:
        dims.append(1)
    return dims[0], dims[1], dims[2]


def explain_launch_config(
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    limits: dict[str, int],
) -> list[str]:
    """Reasons a launch configuration exceeds the device/kernel *limits*.

    *limits* keys (all optional): ``max_threads_per_block`` (the kernel's own limit),
    ``max_block_dim_x/y/z``, ``max_grid_dim_x/y/z``, ``max_dynamic_shared``
    (the kernel's current dynamic shared-memory limit), ``max_shared_optin``
    (the device's opt-in maximum), ``static_shared``, ``num_regs``,
    ``regs_per_block``, ``reqntid`` (product, from the PTX).
    """
    out = []
    threads = block[0] * block[1] * block[2]
    mtpb = limits.get("max_threads_per_block")
    if mtpb is not None and threads > mtpb:
        why = f"block {block} has {threads} threads, more than this kernel's limit of {mtpb}"
        regs = limits.get("num_regs")
        if regs and limits.get("regs_per_block"):
            why += (
                f" (it uses {regs} registers per thread; the SM has "
                f"{limits['regs_per_block']} per block)"
            )
        out.append(why + f"; use a block of at most {mtpb} threads")
    req = limits.get("reqntid")
    if req is not None and threads != req:
        out.append(f"the kernel requires exactly {req} threads per block (.reqntid)")
    for axis, n, key in zip(
        "xyz", block, ("max_block_dim_x", "max_block_dim_y", "max_block_dim_z")
    ):
        lim = limits.get(key)
        if lim is not None and n > lim:
            out.append(f"block.{axis} = {n} exceeds the device maximum {lim}")
    for axis, n in zip("xyz", grid):
        lim = limits.get(f"max_grid_dim_{axis}")
        if lim is not None and n > lim:
            out.append(f"grid.{axis} = {n} exceeds the device maximum {lim}")
    dyn = limits.get("max_dynamic_shared")
    if dyn is not None and shared_mem > dyn:
        why = f"shared_mem={shared_mem} bytes exceeds this kernel's dynamic shared limit ({dyn})"
        optin = limits.get("max_shared_optin")
        static = limits.get("static_shared", 0)
        if optin and shared_mem + static <= optin:
            why += (
                f"; the device allows up to {optin - static} after opting in: "
                "kernel.set_attribute('max_dynamic_shared_size_bytes', n)"
            )
        elif optin:
            why += f"; even opted in the device allows at most {optin} bytes per block"
        out.append(why)
    return out
