"""Where a benchmark's host time goes: a cProfile of one call, as text.

Profiling slows every Python call it sees (driver calls much less), so read the shares
of the entries, not their microseconds.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable


def profile_text(fn: Callable[[], object], top: int = 12) -> str:
    """Run ``fn()`` under cProfile; its *top* entries by own time, from the header row."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text
