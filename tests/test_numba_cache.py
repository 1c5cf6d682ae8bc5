"""numba's cache follows every source a kernel inlines (`recap.numba_cache`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from recap import numba_cache
from recap.core import fast
from recap.verifier.kernels import lanes, ops, quantized_linear


def test_the_sources_stamp_changes_with_any_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = numba_cache.sources_stamp((tmp_path,))
    assert numba_cache.sources_stamp((tmp_path,)) == before
    (tmp_path / "b.py").write_text("y = 3\n")
    assert numba_cache.sources_stamp((tmp_path,)) != before
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "c.py").write_text("")
    assert numba_cache.sources_stamp((tmp_path,)) != before


def test_the_kernels_stamp_their_caches_with_every_source() -> None:
    kernels, core = numba_cache.SOURCES
    assert kernels == Path(quantized_linear.__file__).resolve().parent and core == Path(fast.__file__).resolve().parent
    for function, folders in ((quantized_linear.linear_few, (kernels,)), (ops.quad_attention, (kernels,)),
                              (lanes.dot, (kernels,)), (fast._grow, (core,))):
        locator = function._cache._impl.locator
        assert isinstance(locator, numba_cache.KernelSourcesLocator)
        own, sources = locator.get_source_stamp()
        assert own == locator._inner.get_source_stamp()
        assert sources == numba_cache.sources_stamp(folders)
    assert numba_cache.sources_of(__file__) == numba_cache.SOURCES  # a test's helper: every folder


_MODULE = """
from numba import njit
{use}

@njit(cache=True)
def twice(x):
    return 2 * x
"""

_RUN = """
import json, sys
sys.path.insert(0, {folder!r})
import recap.numba_cache as numba_cache
if {other_sources}:
    numba_cache._stamp_at_start = lambda folders: "other sources"
import {name}
assert {name}.twice(3) == 6
stats = {name}.twice.stats
print(json.dumps({{"locator": type({name}.twice._cache._impl.locator).__name__,
                  "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}}))
"""


def _run(folder: Path, name: str, other_sources: bool = False) -> dict:
    code = _RUN.format(folder=str(folder), name=name, other_sources=other_sources)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cached_function_that_uses_recap_compiles_again_when_the_sources_change(tmp_path: Path) -> None:
    (tmp_path / "uses_recap.py").write_text(_MODULE.format(use="import recap  # noqa: F401"))
    (tmp_path / "no_recap.py").write_text(_MODULE.format(use=""))
    first = _run(tmp_path, "uses_recap")
    assert first == {"locator": "KernelSourcesLocator", "hits": 0, "misses": 1}
    assert _run(tmp_path, "uses_recap") == {"locator": "KernelSourcesLocator", "hits": 1, "misses": 0}
    # the same file, other kernel sources (as after an edit of `lanes`): compiled again, not loaded
    assert _run(tmp_path, "uses_recap", other_sources=True)["hits"] == 0
    # a function that does not touch recap keeps numba's own locator
    assert _run(tmp_path, "no_recap")["locator"] == "InTreeCacheLocator"
