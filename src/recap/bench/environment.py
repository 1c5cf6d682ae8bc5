"""What a timing depends on besides the code: the machine and the library versions."""

from __future__ import annotations

import os
import platform

from recap.machine import cpu_model


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
