"""Saving and loading a stream's token memory U.

Format: a safetensors file (no pickle, no code execution on load) with three tensors,
``keys`` (int64, n), ``ids`` (int64, n x K) and ``probs`` (float32, n x K), and string
metadata: ``format`` = ``recap-token-memory``, ``version`` = ``1``, ``vocab_size``, ``top_k``
and ``sha256``, a checksum of the three tensors' bytes. Confidences are recomputed on load.

A truncated or corrupted file, a checksum mismatch, another format or version, or a
vocabulary that differs from the target's raises `MemoryFileError` with the reason. A loaded
memory only changes which drafts are proposed; verification keeps the output exact.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from recap.core.fast import FastMemory
from recap.core.memory import PredictionMemory
from recap.errors import InputError

FORMAT = "recap-token-memory"
VERSION = "1"


class MemoryFileError(InputError):
    """A memory file that cannot be used; the message says why."""


def _checksum(keys: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in (keys, ids, probs):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def save_token_memory(path: str | os.PathLike, keys: np.ndarray, ids: np.ndarray, probs: np.ndarray, *,
                      vocab_size: int) -> None:
    """Write U (keys [n], ids [n, K], probs [n, K]) atomically: a temporary file, then a
    rename, so an interrupted save never leaves a half-written file under ``path``."""
    from safetensors.numpy import save_file

    keys = np.ascontiguousarray(keys, dtype=np.int64)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    probs = np.ascontiguousarray(probs, dtype=np.float32)
    metadata = {"format": FORMAT, "version": VERSION, "vocab_size": str(vocab_size), "top_k": str(ids.shape[1]),
                "sha256": _checksum(keys, ids, probs)}
    path = os.fspath(path)
    temporary = f"{path}.tmp-{os.getpid()}"
    save_file({"keys": keys, "ids": ids, "probs": probs}, temporary, metadata=metadata)
    os.replace(temporary, path)


@dataclass(frozen=True)
class TokenMemoryFile:
    """A validated U file, installed into a memory once the target's vocabulary is known."""

    path: str
    vocab_size: int
    keys: np.ndarray
    ids: np.ndarray
    probs: np.ndarray

    def install(self, memory: PredictionMemory | FastMemory, vocab_size: int) -> None:
        if vocab_size != self.vocab_size:
            raise MemoryFileError(f"memory file {self.path} was made for a vocabulary of {self.vocab_size} tokens; "
                                  f"this model has {vocab_size}")
        memory.load_unigram(self.keys, self.ids, self.probs)


def read_token_memory(path: str | os.PathLike) -> TokenMemoryFile:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MemoryFileError(f"memory file not found: {path}")
    try:
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise MemoryFileError(f"memory file {path} is truncated or not a RECAP memory file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise MemoryFileError(f"{path} is not a RECAP token-memory file")
    if metadata.get("version") != VERSION:
        raise MemoryFileError(f"{path} has format version {metadata.get('version')!r}; this RECAP reads {VERSION}")
    try:
        keys, ids, probs = tensors["keys"], tensors["ids"], tensors["probs"]
        vocab_size = int(metadata["vocab_size"])
    except (KeyError, ValueError):
        raise MemoryFileError(f"memory file {path} is missing fields") from None
    if _checksum(keys, ids, probs) != metadata.get("sha256"):
        raise MemoryFileError(f"memory file {path} is corrupted (checksum mismatch)")
    if (keys.ndim != 1 or ids.shape != probs.shape or ids.ndim != 2 or len(keys) != len(ids)
            or (keys.size and (keys.min() < 0 or keys.max() >= vocab_size))
            or (ids.size and (ids.min() < 0 or ids.max() >= vocab_size))
            or not np.isfinite(probs).all() or (probs < 0).any()):
        raise MemoryFileError(f"memory file {path} holds inconsistent rows")
    return TokenMemoryFile(path=path, vocab_size=vocab_size, keys=keys, ids=ids, probs=probs)
