"""numba's on-disk cache, keyed by every source a compiled kernel can inline.

Why: numba keys a cached function by its own file alone. A kernel in `quantized_linear`
inlines the code that `lanes`, `quantized` and `widen` generate, so after an edit there a
cached kernel kept the old code: a test once passed against a deliberately broken
de-quantisation (docs/kernels.md). `install` adds one cache locator, in front of numba's,
for functions of this package and for any function whose module uses it (the tests'
helpers): the folder numba would pick, with a stamp that adds a hash of every ``.py`` file
in the function's folder of `SOURCES` (all of them for a function elsewhere) to numba's
own, so any edit there compiles afresh. A
user's own numba functions that do not touch ``recap`` keep numba's locators.
"""

from __future__ import annotations

import functools
import hashlib
import types
from pathlib import Path

from numba.core import caching

PACKAGE = Path(__file__).resolve().parent
_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # named _CacheImpl before numba 0.61
"""numba's cache implementation class, whose ``_locator_classes`` it tries in turn."""
SOURCES = (PACKAGE / "verifier" / "kernels", PACKAGE / "core")
"""Folders whose code the compiled functions inline (intrinsics, ``inline="always"`` helpers)."""


def sources_stamp(folders: tuple[Path, ...] = SOURCES) -> str:
    """A hash of every ``.py`` file in ``folders`` (names and bytes, in name order), read now."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _stamp_at_start(folders: tuple[Path, ...] = SOURCES) -> str:
    # hashed once a process: a source edited while it runs is seen by the next one, as numba
    # itself only reads a file's stamp when a function is first compiled or loaded
    return sources_stamp(folders)


def sources_of(py_file: str) -> tuple[Path, ...]:
    """The folders whose code a function in ``py_file`` can inline: its own, where that is one
    of `SOURCES` (the kernels and `core` import nothing of each other, so an edit of one
    leaves the other's caches valid), else all of them (a test's helper)."""
    folder = Path(py_file).resolve().parent
    return (folder,) if folder in SOURCES else SOURCES


def uses_recap(py_func: types.FunctionType) -> bool:
    """Whether ``py_func`` is this package's or its module refers to something of it."""
    if Path(py_func.__code__.co_filename).resolve().is_relative_to(PACKAGE):
        return True
    for value in py_func.__globals__.values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and (name == "recap" or name.startswith("recap.")):
            return True
    return False


class KernelSourcesLocator(caching._CacheLocator):
    """The locator numba would pick for the function (its ``__pycache__``, ``NUMBA_CACHE_DIR``,
    or the user-wide folder where the package's folder is read-only), with `sources_stamp` of
    `sources_of` its file added to its stamp."""

    def __init__(self, inner: caching._CacheLocator, folders: tuple[Path, ...]):
        self._inner, self._folders = inner, folders

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return self._inner.get_source_stamp(), _stamp_at_start(self._folders)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not uses_recap(py_func):
            return None
        for other in _IMPL._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, sources_of(py_file))
        return None


def install() -> None:
    """Put `KernelSourcesLocator` first in numba's locators (once). Called when ``recap`` is
    imported, before any of its kernels is compiled or loaded."""
    locators = _IMPL._locator_classes
    if KernelSourcesLocator not in locators:
        locators.insert(0, KernelSourcesLocator)
