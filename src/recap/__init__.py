"""RECAP: lossless, training-free speculative decoding for VLMs and LMs on transformers.

Quick start::

    import recap
    target = recap.load("smollm2-135m")
    result = recap.generate(target, "Name three colours.", method="pld")
    print(result.text, result.tau)
    results = recap.generate_batch(target, ["Name a river.", "Name a city."])   # continuous batching
"""

from recap import numba_cache

numba_cache.install()  # before any kernel module is imported: their caches follow every source they inline

from recap.batching import Batch, generate_batch  # noqa: E402
from recap.decoding import DecodeStep, Decoding, GenerationResult, decode, generate  # noqa: E402
from recap.errors import InputError, RecapError  # noqa: E402
from recap.models import load  # noqa: E402
from recap.proposers import PROPOSERS, Proposer, make_proposer  # noqa: E402
from recap.verifier import Target, TargetModel, wrap  # noqa: E402
from recap.verifier.sampling import Sampling  # noqa: E402

__all__ = ["PROPOSERS", "Batch", "DecodeStep", "Decoding", "GenerationResult", "InputError", "Proposer", "RecapError",
           "Sampling", "Target", "TargetModel", "decode", "generate", "generate_batch", "load", "make_proposer", "wrap"]
__version__ = "0.1.0"
