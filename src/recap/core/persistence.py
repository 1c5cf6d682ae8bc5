"""Saving and loading a stream's persistent state: the token memory U and, since version 2,
the stream's earlier outputs (the output store) and its acceptance calibration.

Format: a safetensors file (no pickle, no code execution on load) with tensors ``keys``
(int64, n), ``ids`` (int64, n x K) and ``probs`` (float32, n x K) for U; version 2 adds
``store`` (int64: the remembered outputs, each followed by -1) and ``calibration_trials`` /
``calibration_accepts`` (float64, one per calibration cell), each possibly empty; version 3
adds ``seen_tokens`` / ``seen_requests`` (int64: the request of the stream that last held
each token in its text, so a bounded memory keeps evicting the least recently seen rows
after a restart); version 4 adds ``calibration_expected`` (float64, per cell: the sum of its
labelled nodes' own priors, `recap.core.calibration`). String metadata: ``format`` =
``recap-token-memory``, ``version``, ``vocab_size``, ``top_k`` and ``sha256``, a checksum of
the tensors' bytes. Confidences are recomputed on load. Version 1 (U only), 2 and 3 files
still load (a calibration without ``calibration_expected`` counts each trial at its cell's
prior).

Saving is atomic and durable: a temporary file in the same folder whose name is unique to the
writer (process, thread and a random part, so two concurrent saves of one file never share
it), fsync, rename, folder fsync; a crash during a save leaves either the previous file or
the new one, never a mix, and a failed save removes its temporary file.
A truncated or corrupted file, a checksum mismatch, another format or version, or a
vocabulary that differs from the target's raises `MemoryFileError` with the reason. A loaded
memory only changes which drafts are proposed; verification keeps the output exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from recap.core.fast import FastMemory
from recap.errors import InputError

FORMAT = "recap-token-memory"
VERSION = "4"
READABLE_VERSIONS = ("1", "2", "3", "4")
EXTRA_TENSORS = ("store", "calibration_trials", "calibration_accepts")
"""Version 2's tensors beyond U, in checksum order."""
SEEN_TENSORS = ("seen_tokens", "seen_requests")
"""Version 3's tensors beyond version 2's, in checksum order."""
EXPECTED_TENSORS = ("calibration_expected",)
"""Version 4's tensor beyond version 3's."""
_TENSORS = {"1": (), "2": EXTRA_TENSORS, "3": EXTRA_TENSORS + SEEN_TENSORS,
            "4": EXTRA_TENSORS + SEEN_TENSORS + EXPECTED_TENSORS}
"""Tensors beyond U per readable version."""


class MemoryFileError(InputError):
    """A memory file that cannot be used; the message says why."""


def _checksum(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


TEMPORARY = re.compile(r"\..+\.tmp-(\d+)-\d+-[0-9a-f]{8}")
"""`temporary_path`'s names: hidden (a leading dot, which no tenant's file name can have), the
writer's process id after ``.tmp-``."""


def temporary_path(path: str | os.PathLike) -> str:
    """A temporary name next to ``path`` that no other writer uses: process id, thread id and
    a random part (two threads of one process saving the same file must not share it), hidden
    so that no file a user names (a tenant ``x.tmp-99999-a``) ever matches `TEMPORARY`."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a new file readable by this user only (0600 whatever the umask: the
    mode is given when the file is created) and fsync it."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def private_folder(folder: str | os.PathLike) -> None:
    """Make ``folder`` (and its parents) and set it to 0700: only this user lists or opens what
    is inside, whatever the umask or the folder's earlier mode."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files of saves whose writer died (a SIGKILL or a power cut mid-save
    leaves one; nothing else would ever remove it): names from `temporary_path` whose process
    id is not running. Returns the names removed."""
    removed = []
    for entry in os.scandir(folder):
        match = TEMPORARY.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its writer may still be saving
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # another user's live process, or not a pid at all
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except FileNotFoundError:
            pass
    return removed


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``, atomically and durably: a temporary file
    of this writer's own (`temporary_path`), written 0600 and fsynced (`write_private`),
    renamed over ``path``, then the folder fsynced; a failed write removes its temporary."""
    path = os.fspath(path)
    temporary = temporary_path(path)
    try:
        write_private(temporary, data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    try:  # the rename itself survives a power cut once the folder is synced (POSIX)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


@dataclass(frozen=True)
class MemorySnapshot:
    """A stream's persistent state copied at one moment, written later by `write`. The arrays
    are the snapshot's own (never views of the stream's), so the thread that takes it (the
    server's decoder, with the tenant's lock held) goes on changing the stream while another
    (`recap.serve.saver.MemorySaver`) hashes and writes it: the copy is the decoder's only cost."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]
    """The format's own string fields (extra fields given to `write` never replace them)."""
    checksum: tuple[str, ...] = ()
    """The tensors hashed, in this order, into the ``sha256`` field (none: no such field)."""

    def write(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
        """Write the snapshot to ``path`` as safetensors (`write_atomically`); ``metadata``:
        extra string fields stored with the file's own."""
        from safetensors.numpy import save

        own = dict(self.metadata)
        if self.checksum:
            own["sha256"] = _checksum(*(self.tensors[name] for name in self.checksum))
        fields = {**{str(k): str(v) for k, v in (metadata or {}).items()}, **own}
        write_atomically(path, save(self.tensors, metadata=fields))


def _owned(array: np.ndarray | None, dtype: type) -> np.ndarray:
    """A contiguous copy of ``array`` in ``dtype`` (an empty array for None): never a view."""
    return np.array(np.zeros(0) if array is None else array, dtype=dtype, order="C", copy=True)


def token_memory_snapshot(keys: np.ndarray, ids: np.ndarray, probs: np.ndarray, *, vocab_size: int,
                          store: np.ndarray | None = None, calibration: tuple[np.ndarray, ...] | None = None,
                          last_seen: tuple[np.ndarray, np.ndarray] | None = None) -> MemorySnapshot:
    """A copy of U (keys [n], ids [n, K], probs [n, K]), the output store (flat, -1 after
    each output), the calibration counts (trials, accepts and optionally expected) and the
    recency of tokens (tokens, requests: the bounded memory's eviction order), in the file's
    layout: `MemorySnapshot.write` hashes and writes it (`save_token_memory` does both)."""
    trials, accepts, expected = (*calibration, None)[:3] if calibration is not None else (None,) * 3
    seen_tokens, seen_requests = last_seen if last_seen is not None else (None, None)
    tensors = {name: _owned(array, DTYPES[name]) for name, array in (
        ("keys", keys), ("ids", ids), ("probs", probs), ("store", store), ("calibration_trials", trials),
        ("calibration_accepts", accepts), ("seen_tokens", seen_tokens), ("seen_requests", seen_requests),
        ("calibration_expected", expected))}
    own = {"format": FORMAT, "version": VERSION, "vocab_size": str(vocab_size), "top_k": str(tensors["ids"].shape[1])}
    return MemorySnapshot(tensors, own, checksum=("keys", "ids", "probs", *_TENSORS[VERSION]))


def save_token_memory(path: str | os.PathLike, keys: np.ndarray, ids: np.ndarray, probs: np.ndarray, *,
                      vocab_size: int, store: np.ndarray | None = None,
                      calibration: tuple[np.ndarray, ...] | None = None,
                      last_seen: tuple[np.ndarray, np.ndarray] | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write U, the output store, the calibration counts and the recency of tokens
    (`token_memory_snapshot`) atomically and durably. ``metadata``: extra string fields stored
    with the file's own (which it cannot replace); the scaled server keeps a tenant's save
    version and request count there."""
    token_memory_snapshot(keys, ids, probs, vocab_size=vocab_size, store=store, calibration=calibration,
                          last_seen=last_seen).write(path, metadata)


@dataclass(frozen=True)
class TokenMemoryFile:
    """A validated U file, installed into a memory once the target's vocabulary is known."""

    path: str
    vocab_size: int
    keys: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    store: np.ndarray
    """Earlier outputs, each followed by -1 (empty in version 1 files)."""
    calibration: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None
    """(trials, accepts, expected) per calibration cell (expected None before version 4), or
    None (version 1, or saved without)."""
    last_seen: tuple[np.ndarray, np.ndarray] | None = None
    """(tokens, requests): the stream's request that last held each token, or None (versions
    1 and 2: every loaded row then counts as seen before the first request)."""

    def install(self, memory: FastMemory, vocab_size: int) -> None:
        if vocab_size != self.vocab_size:
            raise MemoryFileError(f"memory file {self.path} was made for a vocabulary of {self.vocab_size} tokens; "
                                  f"this model has {vocab_size}")
        memory.load_unigram(self.keys, self.ids, self.probs)


MAX_FILE_BYTES = 1 << 30
"""The largest memory file `read_token_memory` reads by default (its size is checked before
its body is read): a file past it is refused, never loaded into memory."""
MAX_COUNT = 1 << 53
"""Counters (requests seen, calibration trials) above this are not from a real stream; past
2**53 a float64 count stops counting, past 2**63 an int64 overflows at the next save."""
DTYPES = {"keys": np.int64, "ids": np.int64, "probs": np.float32, "store": np.int64,
          "calibration_trials": np.float64, "calibration_accepts": np.float64, "seen_tokens": np.int64,
          "seen_requests": np.int64, "calibration_expected": np.float64}
"""The dtype each tensor is written with, and must be read with: a float where an id belongs
(NaN compares false with every bound) is refused rather than cast."""


def read_token_memory(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> TokenMemoryFile:
    """A validated token-memory file. Raises `MemoryFileError` for a file that cannot be used
    (missing, past ``max_bytes``, not this format, corrupted, inconsistent); an `OSError`
    while reading (EMFILE, EIO, ...) propagates as it is: the file may be fine, try again."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MemoryFileError(f"memory file not found: {path}")
    size = os.stat(path).st_size
    if size > max_bytes:
        raise MemoryFileError(f"memory file {path} is {size} bytes, more than the {max_bytes} one may take")
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    try:
        metadata = safetensors_metadata(data)
        tensors = load(data)
    except (SafetensorError, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise MemoryFileError(f"memory file {path} is truncated or not a RECAP memory file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise MemoryFileError(f"{path} is not a RECAP token-memory file")
    version = metadata.get("version")
    if version not in READABLE_VERSIONS:
        raise MemoryFileError(f"{path} has format version {version!r}; this RECAP reads "
                              f"{', '.join(READABLE_VERSIONS)}")
    names = ("keys", "ids", "probs", *_TENSORS[version])
    try:
        arrays = [tensors[name] for name in names]
        vocab_size = parse_count(metadata["vocab_size"])
    except (KeyError, ValueError):
        raise MemoryFileError(f"memory file {path} is missing fields") from None
    wrong = [name for name, array in zip(names, arrays) if array.dtype != DTYPES[name]]
    if wrong:
        raise MemoryFileError(f"memory file {path} holds {', '.join(wrong)} in the wrong dtype")
    if _checksum(*arrays) != metadata.get("sha256"):
        raise MemoryFileError(f"memory file {path} is corrupted (checksum mismatch)")
    keys, ids, probs = arrays[:3]
    store = arrays[3] if version != "1" else np.zeros(0, dtype=np.int64)
    expected = arrays[8] if version not in ("1", "2", "3") and arrays[8].size else None
    calibration = (arrays[4], arrays[5], expected) if version != "1" and arrays[4].size else None
    last_seen = (arrays[6], arrays[7]) if version not in ("1", "2") else None
    if (keys.ndim != 1 or ids.shape != probs.shape or ids.ndim != 2 or len(keys) != len(ids)
            or not 0 < vocab_size <= 1 << 31 or len(keys) > vocab_size or len(np.unique(keys)) != len(keys)
            or (keys.size and (keys.min() < 0 or keys.max() >= vocab_size))
            or (ids.size and (ids.min() < 0 or ids.max() >= vocab_size))
            or not np.isfinite(probs).all() or (probs < 0).any()):
        raise MemoryFileError(f"memory file {path} holds inconsistent rows")
    if store.ndim != 1 or (store.size and (store.min() < -1 or store.max() >= vocab_size)):
        raise MemoryFileError(f"memory file {path} holds an inconsistent output store")
    if calibration is not None:
        trials, accepts, expected = calibration
        if (trials.shape != accepts.shape or trials.ndim != 1 or not np.isfinite(trials).all()
                or (trials.size and trials.max() > MAX_COUNT)
                or not np.isfinite(accepts).all() or (accepts < 0).any() or (accepts > trials).any()
                or (expected is not None and (expected.shape != trials.shape or not np.isfinite(expected).all()
                                              or (expected < 0).any() or (expected > trials).any()))):
            raise MemoryFileError(f"memory file {path} holds inconsistent calibration counts")
    if last_seen is not None:
        tokens, requests = last_seen
        if (tokens.ndim != 1 or tokens.shape != requests.shape
                or len(np.unique(tokens)) != len(tokens)
                or (tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size or requests.min() < 0
                                     or requests.max() > MAX_COUNT))):
            raise MemoryFileError(f"memory file {path} holds inconsistent token recency")
    return TokenMemoryFile(path=path, vocab_size=vocab_size, keys=keys, ids=ids, probs=probs, store=store,
                           calibration=calibration, last_seen=last_seen)


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file held in ``data`` (its header: an 8-byte
    little-endian length, then JSON whose ``__metadata__`` holds them)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(data[8:8 + length])
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ValueError("metadata that is not strings")
    return metadata


def file_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of the safetensors file at ``path``, from its header alone (no
    tensor is read). `FileNotFoundError` / `OSError` as the read raises them; `ValueError` for
    a header that is not a safetensors one (damage)."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError("shorter than a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > 100_000_000:  # safetensors' own bound on a header
            raise ValueError("a header longer than safetensors allows")
        return safetensors_metadata(prefix + handle.read(length))


def parse_count(text: str) -> int:
    """A decimal count written by this module: ASCII digits only (``int`` also takes ``"²"``'s
    kin, spaces and underscores)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        raise ValueError(f"not a count: {text[:20]!r}")
    return int(text)
