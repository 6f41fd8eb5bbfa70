"""Every compiler test gets its own kernel cache directory (never the user's)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The private ``CTXKIT_CACHE_DIR`` of this test (inherited by its child processes)."""
    d = tmp_path_factory.mktemp("kcache-parent") / "kcache"
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(d))
    monkeypatch.delenv("CTXKIT_CACHE_MAX_BYTES", raising=False)
    return d
