"""``python -m ctxkit``: the command line (:mod:`ctxkit.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
