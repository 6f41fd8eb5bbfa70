"""How a ``Pipeline.map`` runs, decided before it starts: :func:`plan_map` splits the rows
over devices and chunks and chooses how each side's host data moves; and the checks of a
map's arrays and options. No driver calls: tested on any machine."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..memory.host import plain_dtype
from ..memory.pinned import pinned_pool

__all__ = [
    "PIPELINE_FIELDS",
    "Chunk",
    "HostPieces",
    "MapPlan",
    "PipelineOptions",
    "choose_host_path",
    "default_chunk_bytes",
    "grid_size",
    "host_pieces",
    "plan_map",
    "prepare_io",
    "split_rows",
]


MiB = 1 << 20


DEFAULT_CHUNK_BYTES = 64 * MiB


MIN_CHUNK_BYTES = 1 * MiB


MIN_CHUNKS_PER_DEVICE = 8


#: Slots (pinned in/out staging plus device buffers) per device. Measured on one H200, 16
#: CPUs, 1 GiB float32 pageable in and out, 64 MiB chunks: 4 and 6 slots run at the same
#: speed once the pinned pool holds their blocks (27-32 GB/s in+out), but the first map of
#: a process page-locks every slot it fills: 370 ms with 4, 800 ms with 6.
DEFAULT_STAGING_BUFFERS = 4


#: Bounds of the Pipeline knobs: each slot is a stream with buffers of a chunk, each host
#: thread an OS thread; a map runs at most ``MAX_CHUNKS`` chunks (each costs a few driver
#: calls and host-pool jobs, so a tiny ``chunk_bytes`` would run for hours).
MAX_STAGING_BUFFERS = 64
MAX_HOST_THREADS = 256
MAX_CHUNKS = 1 << 16


SCHEDULES = ("static", "dynamic")


HOST_PATHS = ("auto", "staged", "register", "split")


PAGE = mmap.PAGESIZE


AUTO_HOST_PATH = "staged"


AUTO_REGISTER_MIN_BYTES = 4 * MiB


def split_rows(n_rows: int, n_parts: int) -> list[tuple[int, int]]:
    """Split ``range(n_rows)`` into *n_parts* contiguous ranges whose sizes differ by <= 1.

    Parts may be empty (``n_rows < n_parts``); part ``i`` is
    ``[i * n_rows // n_parts, (i + 1) * n_rows // n_parts)``.
    """
    if n_parts < 1:
        raise ValueError(f"n_parts must be at least 1, got {n_parts}")
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    return [(i * n_rows // n_parts, (i + 1) * n_rows // n_parts) for i in range(n_parts)]


def default_chunk_bytes(total_bytes: int, n_devices: int) -> int:
    """The default chunk size: 64 MiB, smaller when a device would get fewer than 8 chunks
    (at least 1 MiB).

    A staged chunk costs a fixed few driver calls, events and host-pool jobs, so bigger
    chunks are faster (one H200, 1 GiB float32 staged in and out, 6 slots: 16 MiB chunks
    17.2 GB/s, 32 MiB 23.4, 64 MiB 28.6), as long as each device gets enough chunks for
    the fill of one, the GPU work of the next and the drain of a third to overlap.
    """
    per_device = -(-max(total_bytes, 0) // max(n_devices, 1))
    return max(MIN_CHUNK_BYTES, min(DEFAULT_CHUNK_BYTES, per_device // MIN_CHUNKS_PER_DEVICE))


def grid_size(n: int, block: int, max_blocks: int) -> int:
    """Blocks for *n* elements: ``ceil(n / block)``, capped at *max_blocks* (kernels use
    grid-stride loops), at least 1."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return max(1, min(-(-n // block), max(1, max_blocks)))


@dataclass(frozen=True)
class Chunk:
    """Rows ``[row0, row1)`` of the first axis; ``part`` is the device slot that owns it
    under the static schedule (``-1``: assigned at run time, dynamic schedule)."""

    index: int
    part: int
    row0: int
    row1: int

    @property
    def rows(self) -> int:
        """Number of rows in the chunk."""
        return self.row1 - self.row0


HOST_KINDS = ("pageable", "pinned", "held", "managed")


#: How ``RunStats.path`` names a mode that is not named as it is.
MODE_NAMES = {"register": "registered"}


@dataclass(frozen=True)
class PipelineOptions:
    """How a :class:`~ctxkit.pipeline.Pipeline` maps, checked when made.

    Given to the constructor (``Pipeline(devices, options=PipelineOptions(...))``), they
    are the pipeline's defaults (:attr:`Pipeline.options <ctxkit.pipeline.Pipeline.options>`);
    given to one call (``map(..., options=PipelineOptions(schedule="dynamic"))``), they
    change how that call runs. A field left ``None`` takes the pipeline's value (the
    pipeline's takes the default named below). The last four fields set up the pipeline
    itself: a call's options leave them ``None`` or equal to the pipeline's.

    Parameters
    ----------
    chunk_bytes : int, optional
        Chunk size in bytes. Default (``None``): :func:`default_chunk_bytes`, 64 MiB, less
        when a device would get fewer than 8 chunks; a map runs at most 65536 chunks.
    block : int, optional
        Threads per block of a Kernel's launch (1..1024; default 256).
    schedule : {"static", "dynamic"}, optional
        ``"static"`` (the default): an even contiguous share of rows per device.
        ``"dynamic"``: devices take chunks from a shared queue (work stealing; helps
        unequal devices).
    host_path : {"auto", "staged", "register", "split"} or (input, output) pair of them, optional
        How pageable arrays reach the devices (pinned arrays are always copied
        directly): ``"staged"`` copies each chunk through pinned staging buffers (two
        host memory copies per byte); ``"register"`` page-locks the chunk's own pages
        just in time (``cuMemHostRegister``, in parallel on the host pool, a few chunks
        ahead) and DMAs straight from/to them, bouncing only the partial pages at the
        array's ends and chunk boundaries; the pages are unregistered once the chunk's
        D2H completed, before :meth:`~ctxkit.pipeline.Pipeline.map` returns. ``"split"``
        (input only; the output is staged): one host thread registers the input's chunks
        from the last one backwards while the others stage them from the first one
        forwards, meeting in the middle (static schedule; staged under the dynamic one).
        ``"auto"`` (the default): staging, and pin on reuse (see *pin_cache_bytes*).
        Stored as the ``(input, output)`` pair.
    prefetch, to_host : bool, optional
        :meth:`~ctxkit.pipeline.Pipeline.map_managed`: prefetch chunks to the device
        before the kernel / back to the host after (default ``True``).
    staging_buffers : int, optional
        Slots per device (default 4, at most 64): each has a stream, an input and an
        output device buffer and, for pageable data, pinned staging (or small bounce)
        buffers. A slot's buffers are allocated when a map first uses it (pinned ones
        come from the process's pinned pool), reused, grown when a later call needs
        bigger chunks, freed by ``close()`` (pinned ones back to the pool). The staged
        inputs of all slots fill at once on the host pool while the GPU works and
        earlier outputs drain. A device keeps at most this many chunks in flight (twice
        as many when they use no slot buffer), which also bounds what an interrupted map
        waits for.
    host_threads : int, optional
        Threads of the host pool (staging copies, page registration), at most 256.
        Default: 16, at most the usable CPUs minus two per device minus one, at least 2.
    pin_cache_bytes : int, optional
        Pin on reuse, for ``host_path="auto"``: a pageable array (16 MiB or more) that a
        later map call sees again is page-locked once (``cuMemHostRegister``) and kept
        locked while its memory lives, so every further call DMAs it directly, as if it
        were pinned. The bytes from the array's start to the end of its memory owner are
        registered, no byte next to them, so anyone's copies of the owner, its views and
        neighbouring memory behave as before. This bounds the bytes the pipeline keeps
        locked (least recently used arrays are released first); 0 turns it off.
        Default: the process budget. See :meth:`~ctxkit.pipeline.Pipeline.release_pinned`.

        The budget is one per process, shared by every Pipeline (a registration serves
        all of them) and by the pinned pool its staging buffers and pinned outputs come
        from (:func:`ctxkit.pinned_pool`; ``CTXKIT_PINNED_POOL_BYTES``, default a
        quarter of physical memory, at most 64 GiB): an array is held only when the pool
        can make room for it, else it is staged. With several processes per node (MPI
        ranks, ``run_per_device`` workers) each has its own: set
        ``CTXKIT_PINNED_POOL_BYTES`` to about a quarter of the node's memory divided by
        the processes per node.
    trace : bool, optional
        Record events around every stage so that ``trace()`` can show the timeline
        (default ``True``).
    """

    chunk_bytes: int | None = None
    block: int | None = None
    schedule: str | None = None
    host_path: str | tuple[str, str] | None = None
    prefetch: bool | None = None
    to_host: bool | None = None
    staging_buffers: int | None = None
    host_threads: int | None = None
    pin_cache_bytes: int | None = None
    trace: bool | None = None

    def __post_init__(self) -> None:
        _check_count(self.chunk_bytes, "chunk_bytes")
        _check_count(self.staging_buffers, "staging_buffers", MAX_STAGING_BUFFERS)
        _check_count(self.host_threads, "host_threads", MAX_HOST_THREADS)
        block = self.block
        bad = isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1024
        if block is not None and bad:
            raise ValueError(f"block must be an int in 1..1024, got {block!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        pin = self.pin_cache_bytes
        if pin is not None and (isinstance(pin, bool) or not isinstance(pin, int) or pin < 0):
            raise ValueError(
                f"pin_cache_bytes must be a byte count >= 0 (0 turns pin on reuse off), not {pin!r}"
            )
        if self.host_path is not None:
            object.__setattr__(self, "host_path", check_host_path(self.host_path))

    def over(self, base: PipelineOptions | None = None) -> PipelineOptions:
        """These options with each field left ``None`` taken from *base*, then from the
        defaults (``chunk_bytes``, ``host_threads`` and ``pin_cache_bytes`` may stay
        ``None``: chosen per map, per machine, per process)."""
        merged = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and base is not None:
                value = getattr(base, f.name)
            merged[f.name] = _DEFAULTS.get(f.name) if value is None else value
        return PipelineOptions(**merged)

    @property
    def paths(self) -> tuple[str, str]:
        """The ``(input, output)`` host paths (default ``("auto", "auto")``)."""
        return check_host_path(self.host_path or "auto")

    @property
    def slots(self) -> int:
        """Slots per device (``staging_buffers``, or its default)."""
        return self.staging_buffers or DEFAULT_STAGING_BUFFERS


_DEFAULTS: dict[str, Any] = {
    "block": 256,
    "schedule": "static",
    "host_path": ("auto", "auto"),
    "prefetch": True,
    "to_host": True,
    "staging_buffers": DEFAULT_STAGING_BUFFERS,
    "trace": True,
}


#: The fields of :class:`PipelineOptions` that set up a pipeline rather than one call.
PIPELINE_FIELDS = ("staging_buffers", "host_threads", "pin_cache_bytes", "trace")


def _check_count(value: Any, label: str, most: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if value < 1 or (most is not None and value > most):
        allowed = ">= 1" if most is None else f"in 1..{most}"
        raise ValueError(f"{label} must be {allowed}, got {value}")


@dataclass(frozen=True)
class MapPlan:
    """How one map runs, decided before it starts (see :func:`plan_map`).

    The rows are cut into ``chunks`` of ``rows_per_chunk`` rows; under the static
    schedule device slot ``i`` owns the rows ``parts[i]``, under the dynamic one every
    device takes chunks from one queue. ``active`` lists the device slots that run.
    ``in_mode``/``out_mode`` say how each side's host data moves: ``"pinned"`` (the
    array is page-locked), ``"held"`` (kept page-locked by pin on reuse), ``"staged"``
    (through pinned staging buffers), ``"register"`` (its pages locked just in time),
    ``"split"`` (input only: registered from the far end, staged from the near end;
    :mod:`ctxkit.pipeline.run`) or
    ``"managed"`` (unified memory, prefetched). ``in_chunk_bytes``/``out_chunk_bytes``
    size a slot's device buffers; a feeder starts up to ``ahead`` chunks (claims them,
    queues their input fills, begins their registrations) before it enqueues the oldest.
    """

    n_rows: int
    rows_per_chunk: int
    parts: tuple[tuple[int, int], ...]
    chunks: tuple[Chunk, ...]
    schedule: str
    in_mode: str
    out_mode: str
    active: tuple[int, ...]
    ahead: int
    in_chunk_bytes: int
    out_chunk_bytes: int
    prefetch: bool = True
    to_host: bool = True

    def for_part(self, part: int) -> list[Chunk]:
        """The chunks device slot *part* processes under the static schedule."""
        return [c for c in self.chunks if c.part == part]

    @property
    def empty(self) -> bool:
        """True when there is nothing to move (no rows, or rows of zero bytes)."""
        return not self.chunks or not (self.in_chunk_bytes or self.out_chunk_bytes)

    @property
    def managed(self) -> bool:
        """True for a map over unified memory."""
        return self.in_mode == "managed"

    @property
    def stage_in(self) -> bool:
        """True when input chunks go through pinned staging buffers (all or some)."""
        return self.in_mode in ("staged", "split")

    @property
    def stage_out(self) -> bool:
        """True when output chunks go through pinned staging buffers."""
        return self.out_mode == "staged"

    @property
    def registers(self) -> bool:
        """True when a side's pages are registered chunk by chunk."""
        return "register" in (self.in_mode, self.out_mode) or self.in_mode == "split"

    @property
    def bounces(self) -> bool:
        """True when a side's chunks may bounce the bytes at their ends (registered
        pages), so a slot needs its bounce buffer."""
        return self.registers

    @property
    def needs_pool(self) -> bool:
        """True when host threads copy or register for this map."""
        return bool({"staged", "register", "split"} & {self.in_mode, self.out_mode})

    @property
    def path(self) -> str:
        """How the data moves: ``"pinned"``, ``"managed"`` or ``"in=<how>, out=<how>"``."""
        if self.managed:
            return "managed"
        if (self.in_mode, self.out_mode) == ("pinned", "pinned"):
            return "pinned"
        names = [MODE_NAMES.get(m, m) for m in (self.in_mode, self.out_mode)]
        return f"in={names[0]}, out={names[1]}"


def plan_map(
    n_rows: int,
    row_bytes: tuple[int, int],
    n_devices: int,
    options: PipelineOptions | None = None,
    host: tuple[str, str] = ("pageable", "pageable"),
) -> MapPlan:
    """Decide how a map over *n_rows* rows runs on *n_devices* devices.

    Parameters
    ----------
    n_rows : int
        Rows of the first axis.
    row_bytes : (int, int)
        Bytes of one input row and of one output row; chunks are sized by the wider.
    n_devices : int
        Devices of the pipeline.
    options : PipelineOptions, optional
        The map's options (default: ``PipelineOptions()``).
    host : (str, str)
        What the input's and the output's host memory is: ``"pageable"``, ``"pinned"``
        (page-locked), ``"held"`` (kept page-locked by pin on reuse) or, for both sides
        of a map over unified memory, ``"managed"``.

    Static schedule: each device gets a contiguous, even share of the rows, cut into
    chunks of ``max(1, chunk_bytes // row)`` rows. Dynamic: the same chunk size over
    all rows, taken from a shared queue while the devices run (work stealing). A
    pageable side moves by its ``host_path`` (:func:`choose_host_path`).
    """
    options = options or PipelineOptions()
    if n_devices < 1:
        raise ValueError("a map needs at least one device")
    if n_rows < 0 or min(row_bytes) < 0:
        raise ValueError(f"n_rows and row_bytes must be >= 0, got {n_rows} and {row_bytes}")
    if any(k not in HOST_KINDS for k in host):
        raise ValueError(f"host kinds must be in {HOST_KINDS}, not {host!r}")
    row = max(row_bytes)
    chunk_bytes = options.chunk_bytes or default_chunk_bytes(n_rows * row, n_devices)
    rpc = max(1, min(chunk_bytes // row if row else n_rows, n_rows))
    fewest = -(-n_rows // max(1, MAX_CHUNKS - n_devices))  # rows per chunk, at least
    if rpc < fewest and options.chunk_bytes is not None:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} cuts {n_rows} rows of {row} bytes into more than "
            f"{MAX_CHUNKS} chunks, the most one map runs: pass chunk_bytes >= {fewest * row}"
        )
    rpc = max(rpc, fewest)
    parts = tuple(split_rows(n_rows, n_devices))
    static = options.schedule != "dynamic"
    chunks: list[Chunk] = []
    for part, (lo, hi) in enumerate(parts if static else ((0, n_rows),)):
        for r in range(lo, hi, rpc):
            chunks.append(Chunk(len(chunks), part if static else -1, r, min(r + rpc, hi)))
    if "managed" in host:
        if host != ("managed", "managed"):
            raise ValueError(f"a managed map is managed on both sides, not {host!r}")
        modes = host
    else:
        modes = (
            _side_mode(host[0], options.paths[0], n_rows * row_bytes[0], static),
            _side_mode(host[1], options.paths[1], n_rows * row_bytes[1], False),
        )
    active = tuple(sorted({c.part for c in chunks})) if static else tuple(range(n_devices))
    # The staged inputs of every slot fill at once, on the host pool; a dynamic feeder
    # claims fewer ahead of the others, to leave chunks for a faster device to take.
    ahead = 1
    if modes[0] in ("staged", "split"):
        ahead = options.slots if static else min(options.slots, 3)
    if "register" in modes and active:
        # A few chunks ahead keep the registrations off the critical path; more only
        # lengthen a stop (each registered chunk is unregistered before map returns, and
        # cuMemHostUnregister waits for the device).
        per_device = -(-(options.host_threads or 2) // len(active))
        ahead = max(ahead, options.slots, min(per_device, 2 * options.slots))
    return MapPlan(
        n_rows, rpc, parts, tuple(chunks), "static" if static else "dynamic", modes[0],
        modes[1], active, ahead, rpc * row_bytes[0], rpc * row_bytes[1],
        options.prefetch is not False, options.to_host is not False,
    )  # fmt: skip


def _side_mode(kind: str, path: str, nbytes: int, split_ok: bool) -> str:
    if kind != "pageable" and nbytes:
        return kind
    mode = choose_host_path(path, nbytes)
    return "staged" if mode == "split" and not split_ok else mode


#: The string values ``out=`` takes.
OUT_KINDS = ("pinned", "pageable")

#: Default outputs at least this large come from the pinned pool when it has room.
POOLED_OUT_BYTES = 4 << 20


def _default_out(x: np.ndarray, context: Any, headroom: int) -> np.ndarray:
    """The output of ``out=None``: an array of the process's pinned pool when *x* is
    large enough to gain from it and the pool has room without waiting, else
    ``np.empty_like(x)``.

    A pooled output is written by DMA directly: no staging copy and no first touch of
    fresh pages, which together cost about as much as the transfers themselves. Its
    block goes back to the pool when the caller drops the array, so a stream of calls
    keeps reusing the same page-locked memory. A new block must leave *headroom* bytes
    of the pool's budget free: the staging buffers a pageable output would need.
    """
    if x.nbytes < POOLED_OUT_BYTES:
        return np.empty_like(x)
    arr = pinned_pool().try_empty(x.shape, x.dtype, context=context, headroom=headroom)
    return np.empty_like(x) if arr is None else arr


def prepare_io(
    x: Any, out: Any = None, context: Any = None, headroom: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Check the input and output arrays of a map; return ``(x, out)``.

    *x* must be a numpy array with at least one dimension (a non-contiguous one is
    copied to a contiguous array). *out* ``None`` is :func:`_default_out`, ``"pageable"``
    ``np.empty_like(x)``; ``"pinned"`` makes it an array of the process's pinned pool
    (allocated for *context*'s device);
    a given *out* may have another dtype and row shape but the same number of rows, and
    must be C-contiguous, writable, and either the very same memory as *x* or disjoint
    from it.
    """
    if isinstance(out, str) and out not in OUT_KINDS:
        raise ValueError(
            'out must be a numpy array, None, "pinned" (a pooled page-locked array) or '
            f'"pageable" (np.empty_like(x)), not {out!r}'
        )
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"Pipeline.map takes a numpy array, got {type(x).__name__}; convert with "
            "np.asarray(...) (device arrays: launch the kernel on them directly)"
        )
    if x.ndim == 0:
        raise ValueError("Pipeline.map needs an array with at least one dimension, got a 0-d one")
    plain_dtype(x.dtype, "Pipeline.map: x")
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if out is None:
        return x, _default_out(x, context, headroom)
    if isinstance(out, str):
        if out == "pageable":
            return x, np.empty_like(x)
        return x, pinned_pool().empty(x.shape, x.dtype, context=context)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    plain_dtype(out.dtype, "Pipeline.map: out")
    if out.ndim == 0 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"out must have as many rows as x (first axis): x.shape={x.shape}, "
            f"out.shape={out.shape}"
        )
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous (pass np.empty(...) or omit out)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    if np.may_share_memory(x, out) and not (addr(x) == addr(out) and x.nbytes == out.nbytes):
        raise ValueError("out partially overlaps x; pass out=x (in place) or disjoint memory")
    return x, out


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def row_bytes(a: np.ndarray) -> int:
    return a.nbytes // a.shape[0] if a.shape[0] else 0


def round_up(n: int, to: int = MiB) -> int:
    return -(-n // to) * to


def check_host_path(host_path: Any) -> tuple[str, str]:
    """``(input, output)`` host paths from ``"auto"``/``"staged"``/``"register"``/``"split"``
    or a pair of them."""
    pair = (host_path, host_path) if isinstance(host_path, str) else host_path
    if not isinstance(pair, tuple) or len(pair) != 2 or any(p not in HOST_PATHS for p in pair):
        raise ValueError(
            f"host_path must be one of {HOST_PATHS} or an (input, output) pair of them, "
            f"not {host_path!r}"
        )
    return pair[0], pair[1]


def choose_host_path(requested: str, nbytes: int) -> str:
    """How a pageable side of *nbytes* moves: *requested*, or for ``"auto"``
    :data:`AUTO_HOST_PATH` from :data:`AUTO_REGISTER_MIN_BYTES` up and staging below
    (registering costs a few driver calls per chunk that a small array does not repay).

    :data:`AUTO_HOST_PATH` is ``"staged"``: on 2x H200 with 32 CPUs (512 MiB float32
    pageable in and out, 2 GPUs) staging reached 20.6 GB/s, registration 5.9 GB/s
    (``cuMemHostRegister`` + ``cuMemHostUnregister`` of 256 MiB in and out took 71.5 +
    49.8 ms per device, ~3.6 GB/s, and concurrent registrations do not scale).
    """
    if requested != "auto":
        return requested
    return AUTO_HOST_PATH if nbytes >= AUTO_REGISTER_MIN_BYTES else "staged"


@dataclass(frozen=True)
class HostPieces:
    """How the bytes of one chunk of a pageable array move when its pages are registered.

    The chunk's bytes are ``head`` bytes copied through a small pinned bounce buffer,
    then ``direct`` bytes DMAed straight from/to the registered pages
    ``[seg_ptr, seg_ptr + seg_len)``, then ``tail`` bounced bytes. Only whole pages are
    registered and each page by at most one chunk: a chunk owns the pages that start
    inside it, so the partial page at its start belongs to the chunk before (and its
    bytes are bounced), as do the partial pages at both ends of the array.
    """

    head: int
    direct: int
    tail: int
    seg_ptr: int
    seg_len: int

    @property
    def bounced(self) -> int:
        """Bytes that go through the bounce buffer (``head + tail``)."""
        return self.head + self.tail


def host_pieces(base: int, total: int, b0: int, b1: int, page: int = PAGE) -> HostPieces:
    """Split bytes ``[b0, b1)`` of the array at address *base* (*total* bytes long).

    ``head`` and ``tail`` are each shorter than a page; a chunk that owns no whole page
    (it lies within one page, or in the partial page at the end) is all ``head``
    (shorter than two pages).
    """
    if not 0 <= b0 <= b1 <= total:
        raise ValueError(f"bytes [{b0}, {b1}) are not inside an array of {total} bytes")
    a0, a1 = base + b0, base + b1
    last = (base + total) // page * page
    s0 = -(-a0 // page) * page
    s1 = min(-(-a1 // page) * page, last)
    if s1 <= s0:
        return HostPieces(b1 - b0, 0, 0, 0, 0)
    end = min(a1, s1)
    return HostPieces(s0 - a0, end - s0, a1 - end, s0, s1 - s0)
