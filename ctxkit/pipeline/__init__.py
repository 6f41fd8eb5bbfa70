"""Multi-device copy -> kernel -> copy pipelines over host numpy arrays.

``Pipeline.map`` splits the first axis of a host array over devices and chunks. Per chunk
it runs H2D copy -> ``kernel(d_in, d_out, n, *args)`` -> D2H copy, and keeps every device
busy at once:

* each device is driven by its own worker thread (a ``ContextExecutor`` bound to the
  device's shared context), so a call that blocks on one device never stalls another;
* options travel together in one :class:`PipelineOptions` (``Pipeline(devices,
  options=...)``, ``map(..., options=...)``);
* pageable input and output are never copied synchronously: by default (``host_path=
  "auto"``, i.e. ``"staged"``) they go through pinned staging buffers
  (``staging_buffers`` per device, filled and drained in pieces by a pool of host
  threads that takes fills first; the fills of several chunks, the transfers and
  kernels of others and the drains of earlier ones all overlap, with no per-chunk
  barrier); ``host_path="register"`` instead registers the pages of each chunk just in
  time and DMAs them directly (only the partial pages at the ends are bounced through a
  tiny pinned buffer); ``host_path="split"`` registers the input from its far end while
  staging it from the near end, meeting in the middle;
* pinned input/output (``ctxkit.pinned_empty``, ``register_host``) is copied directly,
  fully asynchronously (the zero-copy path); ``out="pinned"`` returns the output in
  page-locked memory of the process's pinned pool (``ctxkit.pinned_pool``);
* staging and bounce buffers come from that pool too, and pin on reuse counts its
  registrations against its budget: a new Pipeline page-locks nothing that an earlier
  one gave back, and all of them together stay within one process budget;
* the chunk stages are NVTX ranges (``h2d``, ``kernel``, ``d2h``, ``fill``, ``drain``;
  :mod:`ctxkit.trace`), and ``map(..., progress=True)`` shows a progress bar;
* a closed Pipeline leaves its host threads idle for the next one
  (:func:`close_idle_host_threads` joins them).

How a map runs (chunks, devices, host paths) is decided before it starts by
:func:`plan_map` from its :class:`PipelineOptions`, into a :class:`MapPlan`.
``Pipeline.submit`` enqueues cross-device stages ordered by events
(``cuStreamWaitEvent``); ``Pipeline.map_managed`` runs the same map over unified memory
with per-device prefetch. ``Pipeline.trace`` returns the :class:`~ctxkit.trace.Timeline`
of the last run.
"""

from __future__ import annotations

from ..errors import PipelineError
from .pipeline import Pipeline
from .plan import (
    Chunk,
    HostPieces,
    MapPlan,
    PipelineOptions,
    default_chunk_bytes,
    grid_size,
    host_pieces,
    plan_map,
    prepare_io,
    split_rows,
)
from .run import ChunkView, DeviceStats, RunStats
from .stages import StageHandle
from .staging import close_idle_host_threads

__all__ = [
    "Chunk",
    "ChunkView",
    "DeviceStats",
    "HostPieces",
    "MapPlan",
    "Pipeline",
    "PipelineError",
    "PipelineOptions",
    "RunStats",
    "StageHandle",
    "close_idle_host_threads",
    "default_chunk_bytes",
    "grid_size",
    "host_pieces",
    "plan_map",
    "prepare_io",
    "split_rows",
]
