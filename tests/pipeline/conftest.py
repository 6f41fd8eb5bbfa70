"""Every pipeline test starts with an empty process pin cache and an empty process pinned
pool (both are one per process, so one test's sightings, registrations and cached blocks,
made on its own simulated GPU, must not reach the next)."""

from __future__ import annotations

import pytest

from ctxkit.memory import pinned
from ctxkit.pipeline import pincache


@pytest.fixture(autouse=True)
def _fresh_pin_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pincache, "_process", None)
    monkeypatch.setattr(pinned, "_process_pool", None)
