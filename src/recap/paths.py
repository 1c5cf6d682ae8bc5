"""Where recap keeps what it builds or measures: built models, cost profiles, bench data. Its
own module because the loaders, the cost profiles and the bench all read it, and none of
them should import another for it (that was part of an import circle, issue 47)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where recap caches what it builds or measures: ``$RECAP_CACHE`` or ``~/.cache/recap``."""
    return Path(os.environ.get("RECAP_CACHE", Path.home() / ".cache" / "recap")).expanduser()


def model_cache_dir() -> Path:
    """Where the built-in models are built: ``$RECAP_MODEL_CACHE``, else `cache_dir`."""
    folder = os.environ.get("RECAP_MODEL_CACHE")
    return Path(folder).expanduser() if folder else cache_dir()
