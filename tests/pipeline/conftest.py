"""Every pipeline test starts with an empty process pin cache (pin on reuse is one cache
per process, so one test's sightings and registrations must not reach the next)."""

from __future__ import annotations

import pytest

from ctxkit.pipeline import pincache


@pytest.fixture(autouse=True)
def _fresh_pin_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pincache, "_process", None)
