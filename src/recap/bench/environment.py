"""What a timing depends on besides the code: the machine and the library versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores_available": cores, "cores_total": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    import numpy
    import torch
    import transformers

    import recap

    return {"recap": recap.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__}
