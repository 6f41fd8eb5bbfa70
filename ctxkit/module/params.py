"""Kernel arguments: which device address each carries, where it lives, how it is packed.

Pointers: ctxkit buffers and arrays (``.ptr``), ``__cuda_array_interface__`` objects (CuPy,
Numba, PyTorch), DLPack producers and page-locked/managed numpy arrays all pass as
device pointers. The way to read each type's address is worked out once per type and
cached, so the launch hot path pays one dictionary lookup per pointer argument.

Memory arguments: a ctxkit buffer or array knows its context: one of another device is
refused unless the launch's context has peer access to it (a kernel reading it would fault,
and a fault poisons every context of the process); managed memory passes everywhere.
Foreign arrays (CuPy, PyTorch, ``__cuda_array_interface__``, DLPack) are used after their
producer stream (:mod:`ctxkit.memory.interop`). The packer calls these only off its inline
fast path.

Packing (no driver): :class:`ArgPacker` checks Python arguments against a kernel's parameter
list (see :mod:`ctxkit.module.ptxsig`) and packs them, at the device-side offsets, into one
buffer plus the ``void**`` array ``cuLaunchKernel`` takes. PTX does not mark pointers
reliably (NVRTC emits ``.u64`` for both ``float*`` and ``size_t``), so a 64-bit integer
parameter takes a device pointer or an integer, while floats and narrower integers refuse
pointers. Integers must fit the parameter's width, and a parameter whose C++ type is
unsigned (see :mod:`ctxkit.module.ptxsig`) refuses negative values.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..context import Context
from ..errors import LaunchArgumentError
from ..memory.copies import peer_access_enabled
from ..memory.device import DeviceArray, DeviceBuffer
from ..memory.host import host_device_pointer, plain_dtype
from ..memory.interop import DLTensor, order_after_producers
from ..memory.managed import ManagedBuffer
from .ptxsig import BITS, BYTES, FLOAT, INT, Param, Signature

__all__ = [
    "ArgPacker",
    "ParamBuffer",
    "device_pointer",
    "dlpack_pointer",
    "foreign_arrays",
    "short_repr",
]


class Refused(Exception):
    """A value does not fit a parameter; the message says why."""


_HOST_ARRAY_FIX = (
    "copy it to the device first (ck.DeviceBuffer / ck.device_array) or allocate it "
    "device-visible (ck.pinned_empty, ck.ManagedBuffer(...).as_numpy())"
)


def _ndarray_pointer(arr: np.ndarray, ctx: Any = None) -> int:
    plain_dtype(arr.dtype, "kernel argument")
    ptr = host_device_pointer(arr)
    if ptr is None:
        raise Refused(
            f"got a numpy array {arr.shape} {arr.dtype} in pageable host memory, which a "
            f"kernel cannot read; {_HOST_ARRAY_FIX}"
        )
    return int(ptr)


def _torch_pointer(t: Any, ctx: Any = None) -> int:
    if not t.is_cuda:
        raise Refused(f"got a torch tensor on {t.device} (host memory); move it with .cuda()")
    if ctx is not None and (there := t.get_device()) != ctx.device.ordinal:
        _foreign_reachable(t, there, ctx)
    return int(t.data_ptr())


def _cupy_pointer(a: Any, ctx: Any = None) -> int:
    mem = a.data  # CuPy's managed memory (ManagedMemory) is usable from every device
    there = mem.device_id
    if (
        ctx is not None
        and there != ctx.device.ordinal
        and type(mem.mem).__name__ != "ManagedMemory"
    ):
        _foreign_reachable(a, there, ctx)
    return int(mem.ptr)


def _foreign_reachable(v: Any, there: int, ctx: Context) -> None:
    """Refuse a PyTorch/CuPy array of device *there* in a launch in *ctx* (another
    device) unless *ctx* has peer access to that device (see :func:`_reachable`)."""
    if not peer_access_enabled(ctx, there):
        library = (type(v).__module__ or "").split(".")[0]
        raise _unreachable(f"{library} {type(v).__name__}", there, ctx)


def _attr_pointer(a: Any, ctx: Any = None) -> int:
    return int(a.ptr)


def _cai_pointer(a: Any, ctx: Any = None) -> int:
    return int(a.__cuda_array_interface__["data"][0] or 0)


_DLPACK_HOST = 1


_DLPACK_DEVICE_TYPES = {2, 3, 13}  # CUDA, CUDA host (pinned), CUDA managed


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer


_capsule_pointer.restype = ctypes.c_void_p


_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_pointer(obj: Any) -> int:
    """Address of the first element of a DLPack producer (``__dlpack__``)."""
    capsule = obj.__dlpack__()  # alive while its tensor is read
    tensor = DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    return (tensor.data or 0) + tensor.byte_offset


def _dlpack_device_pointer(obj: Any, ctx: Any = None) -> int:
    dev_type = int(obj.__dlpack_device__()[0])
    if dev_type not in _DLPACK_DEVICE_TYPES:
        where = "host memory" if dev_type == _DLPACK_HOST else f"DLPack device type {dev_type}"
        raise Refused(f"got a {type(obj).__name__} in {where}; a kernel needs device memory")
    return dlpack_pointer(obj)


#: type -> ``pointer(value, ctx=None)`` of the memory types seen: their device address,
#: for ctxkit buffers and arrays checked to be reachable from the launch's context *ctx*
pointer_of: dict[type, Callable[..., int]] = {}


#: the types seen that are not memory
_not_memory: set[type] = set()


def _classify(v: Any) -> Callable[..., int] | None:
    t = type(v)
    if isinstance(v, np.ndarray):
        return _ndarray_pointer
    if isinstance(v, DeviceBuffer):
        return _buffer_pointer
    if isinstance(v, DeviceArray):
        return _array_pointer
    if isinstance(v, np.generic) or hasattr(t, "__cuda_stream__"):
        return None  # numbers, and streams (which carry .ptr too) are not memory
    mod = t.__module__ or ""
    if mod.startswith("torch") and hasattr(v, "data_ptr") and hasattr(v, "is_cuda"):
        return _torch_pointer
    if mod.startswith("cupy") and hasattr(getattr(v, "data", None), "ptr"):
        return _cupy_pointer
    if hasattr(t, "ptr") or "ptr" in getattr(v, "__dict__", ()):
        return _attr_pointer
    if hasattr(v, "__cuda_array_interface__"):
        return _cai_pointer
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        return _dlpack_device_pointer
    return None


def pointer_getter(v: Any) -> Callable[..., int] | None:
    """How to read *v*'s device address, worked out once per type: ``pointer(v, ctx=None)``
    (see :data:`pointer_of`), or ``None`` when *v* is not a memory object."""
    t = type(v)
    g = pointer_of.get(t)
    if g is None and t not in _not_memory:
        g = _classify(v)  # a race works it out twice: harmless
        if g is None:
            _not_memory.add(t)
        else:
            pointer_of[t] = g
    return g


def device_pointer(v: Any) -> int | None:
    """The device address *v* carries, or ``None`` when *v* is not a memory object.

    Understands ctxkit buffers and arrays (``.ptr``), ``__cuda_array_interface__``
    (CuPy, Numba, PyTorch), DLPack producers and page-locked/managed numpy arrays.

    Raises
    ------
    LaunchArgumentError
        *v* is memory a kernel cannot use (pageable numpy array, CPU tensor).
    """
    g = pointer_getter(v)
    if g is None:
        return None
    try:
        return g(v)
    except Refused as exc:
        raise LaunchArgumentError(str(exc)) from None


def short_repr(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _buffer_pointer(v: DeviceBuffer, ctx: Context | None = None) -> int:
    return _reachable(v, v, ctx)


def _array_pointer(v: DeviceArray, ctx: Context | None = None) -> int:
    return _reachable(v, v.buffer, ctx)


def _reachable(v: Any, buf: DeviceBuffer, ctx: Context | None) -> int:
    """The address of *buf* (the memory of *v*), refused when it is memory of another
    device the launch's context *ctx* cannot access.

    A kernel reading it would fault, and a fault poisons every context of the process.
    Managed memory, memory of the launch's own device and peer-enabled pairs pass
    (``None``: no check).
    """
    owner = buf.context
    if owner is ctx or ctx is None:
        return buf.ptr
    there, here = owner.device.ordinal, ctx.device.ordinal
    if there == here or isinstance(buf, ManagedBuffer) or peer_access_enabled(ctx, owner):
        return buf.ptr
    view = " (a view)" if buf.base is not None else ""
    raise _unreachable(f"{type(v).__name__}{view}", there, ctx, f" ({owner!r})")


def _unreachable(what: str, there: int, ctx: Context, owner: str = "") -> Refused:
    """The refusal of *what*, memory on device *there* (of context *owner*), in a launch
    in *ctx* on another device without peer access to it."""
    here = ctx.device.ordinal
    return Refused(
        f"got a {what} on device {there}{owner}, but the kernel launches on device {here} "
        f"({ctx!r}) without peer access to it; the kernel would fault. Enable it first "
        f"(ck.enable_peer_access(<device {here} context>, <device {there} context>), once; "
        f"see ck.Device({here}).can_access_peer), or copy the data to device {here} "
        "(ck.copy_peer, or the array library's own copy), or use managed memory "
        "(ck.ManagedBuffer)"
    )


#: argument types that never need ordering after a producer stream
OWN_TYPES = frozenset({int, bool, float, type(None), DeviceBuffer, DeviceArray, ManagedBuffer})


def foreign_arrays(args: Sequence[Any]) -> list[Any]:
    """The arguments that may have a producer stream: not numbers, bytes, host arrays or
    ctxkit buffers."""
    return [
        v
        for v in args
        if type(v) not in OWN_TYPES
        and not isinstance(v, (np.ndarray, np.generic, bytes, bytearray, memoryview))
    ]


def _int_range(p: Param) -> tuple[int, int]:
    """``[lo, hi)`` of the values a parameter takes: both signs' when its sign is unknown."""
    bits = p.size * 8
    lo = 0 if p.unsigned else -(1 << (bits - 1))
    hi = 1 << (bits - 1) if p.signed else 1 << bits
    return lo, hi


def _range_message(p: Param, x: int, lo: int, hi: int) -> str:
    if x < 0 and lo == 0:
        return (
            f"got {x}, a negative value for an unsigned parameter ({p.ctype or p.ptx_type}): "
            f"the kernel would read it as {x & ((1 << (p.size * 8)) - 1)}. Pass a value in "
            f"0..{hi - 1}"
        )
    what = f"{p.ctype}, " if p.ctype else ""
    return f"got {x}, out of range for .{p.type} ({what}valid: {lo}..{hi - 1})"


def _as_int(p: Param, v: Any, ctx: Context | None) -> int:
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
            return g(v, ctx)
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


def _int_converter(p: Param) -> Callable[[Any, Any], int]:
    lo, hi = _int_range(p)
    mask = (1 << (p.size * 8)) - 1
    wrap = not (p.signed or p.unsigned)
    known = pointer_of if p.accepts_pointer else {}

    def conv(v: Any, ctx: Any) -> int:
        if type(v) is int:
            x = v
        else:
            g = known.get(type(v))
            if g is not None:
                return g(v, ctx)
            x = _as_int(p, v, ctx)
        if not lo <= x < hi:
            raise Refused(_range_message(p, x, lo, hi))
        return x & mask if wrap else x

    return conv


_FLOAT_MAX = {2: 65504.0, 4: 3.4028234663852886e38, 8: float("inf")}


_INF = float("inf")


def _float_converter(p: Param) -> Callable[[Any, Any], float]:
    limit = _FLOAT_MAX[p.size]

    def conv(v: Any, ctx: Any) -> float:
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
        plain_dtype(v.dtype, "kernel argument")
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


def _bytes_converter(p: Param) -> Callable[[Any, Any], bytes]:
    return lambda v, ctx: _to_bytes(p, v)


def _bits_converter(p: Param) -> Callable[[Any, Any], int]:
    as_int = _int_converter(p)

    def conv(v: Any, ctx: Any) -> int:
        t = type(v)
        if t is int:
            return as_int(v, ctx)
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
        return as_int(v, ctx)

    return conv


#: parameter kind -> the maker of its converter ``conv(value, ctx)``
_CONVERTER = {
    INT: _int_converter,
    FLOAT: _float_converter,
    BITS: _bits_converter,
    BYTES: _bytes_converter,
}


def _inline(p: Param, i: int) -> str:
    """The packing expression of argument *i*: common values inline, the rest converted.

    A Python ``int`` or ``float`` is packed as it is when :mod:`struct` checks the same
    range the converter would (a failure is explained argument by argument afterwards);
    an ``int`` of unknown sign goes through the converter only when it is negative. A
    ctxkit buffer or array of the launch's own context costs two attribute reads; a
    memory type seen before (CuPy, PyTorch, CAI objects) one dictionary lookup.
    """
    a, t, c = f"a{i}", f"t{i}", f"c{i}(a{i}, ctx)"
    if p.kind == INT and not p.count:
        guard = "" if (p.signed or p.unsigned) else f" and {a} >= 0"
        if not p.accepts_pointer:
            return f"({a} if type({a}) is int{guard} else {c})"
        return (
            f"({a} if ({t} := type({a})) is int{guard} "
            f"else {a}.ptr if {t} is DeviceBuffer and {a}.context is ctx "
            f"else {a}.buffer.ptr if {t} is DeviceArray and {a}.buffer.context is ctx "
            f"else pointer_of[{t}]({a}, ctx) if {t} in pointer_of "
            f"else {c})"
        )
    if p.kind == FLOAT:
        return f"({a} if type({a}) is float else {c})"
    return c


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

    Every method takes the launch's context (*ctx*): ctxkit buffers of another device are
    refused unless that context has peer access to them. ``None`` skips that check.

    Attributes
    ----------
    pack_into : callable
        ``pack_into(buf, args, ctx=None)``: check *args* and write them into the
        :class:`ParamBuffer` *buf*.
    address : callable
        ``address(args, ctx=None, stream=None, consumer=None)``: pack *args* into this
        thread's reusable buffer and return its ``void**`` address (what the launch hot
        path calls). The buffer is reused by the next call in the same thread, which is
        safe because ``cuLaunchKernel`` copies the parameters before it returns. With a
        context, *stream* (a handle, ``None``: legacy default) is ordered after the
        producers of foreign array arguments; *consumer* is the stream object it came
        from (its flags can make a wait unnecessary; ``None``: the thread's current
        stream).
    """

    __slots__ = ("_convs", "_n", "_one", "address", "kernel", "pack_into", "sig")

    def __init__(self, sig: Signature, kernel: str | None = None) -> None:
        self.sig = sig
        self.kernel = kernel or sig.name
        self._n = len(sig.params)
        self._convs = tuple(_CONVERTER[p.kind](p) for p in sig.params)
        self._one = tuple(struct.Struct("<" + p.code) for p in sig.params)
        self.pack_into, self.address = self._compile()

    def _compile(self) -> tuple[Any, Any]:
        """:attr:`pack_into` and :attr:`address`, each one generated function.

        Generated so the hot path has no per-argument loop or call for plain numbers
        (about half the cost of a comprehension); the source contains only generated
        names, never user input, and runs with this module's names. ``address`` packs
        into the calling thread's reusable buffer and, when an argument is a foreign array
        (not a number or a ctxkit buffer), orders *hs* (the handle of *so*, the launch's
        stream object) after its producer
        (:func:`~ctxkit.memory.interop.order_after_producers`).
        """
        params = self.sig.params
        n = len(params)
        names = "".join(f"a{i}, " for i in range(n))
        exprs = ", ".join(_inline(p, i) for i, p in enumerate(params))
        unpack = (
            f"    try:\n        {names}= a\n    except ValueError:\n"
            "        raise packer._count_error(a) from None\n"
            if n
            else "    if a:\n        raise packer._count_error(a)\n"
        )
        pack = (
            f"    try:\n        pack(d, 0, {exprs})\n    except Exception as exc:\n"
            "        raise packer._explain(a, ctx, exc) from None\n"
            if n
            else ""
        )
        own = [
            f"t{i} in OWN_TYPES" if p.kind == INT else f"type(a{i}) in OWN_TYPES"
            for i, p in enumerate(params)
            if p.accepts_pointer
        ]
        order = f"    if not ({' and '.join(own)}):\n        order(a, hs, ctx, so)\n" if own else ""
        src = (
            f"def pack_into(b, a, ctx=None):\n{unpack}    d = b.data\n{pack}\n"
            f"def address(a, ctx=None, hs=None, so=None):\n{unpack}"
        ) + (
            "    try:\n        d, address, _ = local.buf\n    except AttributeError:\n"
            "        b = ParamBuffer(packer.sig)\n"
            "        d, address, _ = local.buf = (b.data, b.address, b)\n"
            f"{pack}{order}    return address\n"
            if n
            else "    return 0\n"
        )
        namespace = {**globals(), "packer": self, "local": threading.local()}
        layout = struct.Struct(_layout_format(params, self.sig.size))
        namespace.update(order=order_after_producers, pack=layout.pack_into)
        namespace.update((f"c{i}", c) for i, c in enumerate(self._convs))
        exec(src, namespace)
        return namespace["pack_into"], namespace["address"]

    # -- checking --------------------------------------------------------------------

    def _check_one(self, i: int, v: Any, ctx: Context | None) -> Any:
        p = self.sig.params[i]
        try:
            x = self._convs[i](v, ctx)
            self._one[i].pack(x)
        except (Refused, LaunchArgumentError) as exc:
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
        inner = ", ".join(
            f"{p.ptx_type} {p.name}" + (f" ({p.ctype})" if p.ctype else "") for p in self.sig.params
        )
        return f"{self.kernel}({inner})"

    def _count_error(self, args: Sequence[Any]) -> LaunchArgumentError:
        given = ", ".join(type(a).__name__ for a in args) or "none"
        return LaunchArgumentError(
            f"{self.kernel} takes {self._n} argument{'s' if self._n != 1 else ''} but "
            f"{len(args)} were given ({given}). Signature: {self._signature_text()}"
        )

    def _explain(self, args: Sequence[Any], ctx: Any, exc: BaseException) -> BaseException:
        """The error for arguments that failed to pack: the first that does not fit."""
        if not isinstance(exc, (struct.error, OverflowError, TypeError, ValueError, Refused)):
            return exc  # e.g. ContextClosedError from a closed buffer
        for i, v in enumerate(args):
            try:
                self._check_one(i, v, ctx)
            except LaunchArgumentError as err:
                return err
        return LaunchArgumentError(f"{self.kernel}: cannot pack the arguments: {exc}")

    # -- packing ---------------------------------------------------------------------

    def packed(self, args: Sequence[Any], ctx: Context | None = None) -> ParamBuffer:
        """A new :class:`ParamBuffer` holding *args*, checked (padding bytes are zero)."""
        buf = ParamBuffer(self.sig)
        self.pack_into(buf, args, ctx)
        return buf

    def pack(self, args: Sequence[Any], ctx: Context | None = None) -> bytes:
        """The device-side parameter buffer for *args* (padding bytes are zero)."""
        return bytes(self.packed(args, ctx))

    def pack_one(
        self, buf: ParamBuffer, index: int, value: Any, ctx: Context | None = None
    ) -> None:
        """Check and write the argument of parameter *index* only."""
        x = self._check_one(index, value, ctx)
        self._one[index].pack_into(buf.data, self.sig.params[index].offset, x)

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
