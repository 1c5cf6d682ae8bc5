"""Which replica decodes a tenant's request: consistent hashing with bounded loads
(Mirrokni, Thorup and Zadimoghaddam, 2018).

Each replica has ``points`` places on a hash ring; a tenant hashes to a place and its request
goes to the first replica clockwise whose load (requests it has in flight) is below the
bound ``max(min_bound, ceil(load_factor * (in flight + 1) / replicas))`` (``min_bound``: the
requests a replica decodes at once, so a replica with free lanes is never called hot). A tenant therefore stays on one
replica (its stream and memory stay warm there) while that replica is not hot, and a hot
replica's extra requests spill to the next replicas on the ring instead of queueing without
bound; no replica ever holds more than the bound. Removing a replica moves only the tenants
it had. Hashes are blake2b, so every process and every run agree.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import threading
from collections.abc import Hashable, Iterable


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class TenantRouter:
    """The ring, and the load of each replica (thread-safe)."""

    def __init__(self, replicas: Iterable[Hashable], *, points: int = 64, load_factor: float = 1.25,
                 min_bound: int = 1):
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, got {load_factor}")
        self.points, self.load_factor, self.min_bound = points, load_factor, max(1, min_bound)
        self.loads: dict[Hashable, int] = {}
        self._ring: list[tuple[int, str, Hashable]] = []
        self._lock = threading.Lock()
        for replica in replicas:
            self.add(replica)

    @property
    def replicas(self) -> list[Hashable]:
        return list(self.loads)

    def add(self, replica: Hashable) -> None:
        with self._lock:
            if replica in self.loads:
                raise ValueError(f"replica {replica!r} is on the ring already")
            self.loads[replica] = 0
            for i in range(self.points):
                bisect.insort(self._ring, (_hash(f"{replica!r}#{i}"), repr(replica), replica))

    def remove(self, replica: Hashable) -> None:
        """Take a replica off the ring (it died); its tenants move to the next replicas."""
        with self._lock:
            if self.loads.pop(replica, None) is None:
                return
            self._ring = [entry for entry in self._ring if entry[2] != replica]

    def bound(self, extra: int = 1) -> int:
        """Most requests one replica may hold once ``extra`` more are placed."""
        total = sum(self.loads.values()) + extra
        return max(self.min_bound, math.ceil(self.load_factor * total / max(1, len(self.loads))))

    def order(self, tenant: str) -> list[Hashable]:
        """The replicas in ring order from the tenant's place (its owner first)."""
        with self._lock:
            return self._order(tenant)

    def _order(self, tenant: str) -> list[Hashable]:
        if not self._ring:
            return []
        start = bisect.bisect(self._ring, (_hash(tenant), "", None))
        seen: dict[Hashable, None] = {}
        for i in range(len(self._ring)):
            replica = self._ring[(start + i) % len(self._ring)][2]
            if replica not in seen:
                seen[replica] = None
                if len(seen) == len(self.loads):
                    break
        return list(seen)

    def owner(self, tenant: str) -> Hashable | None:
        """Where the tenant's requests go while no replica is hot."""
        order = self.order(tenant)
        return order[0] if order else None

    def acquire(self, tenant: str, exclude: Iterable[Hashable] = ()) -> Hashable | None:
        """The replica for one more request of ``tenant`` (its load counted until `release`):
        the first on the ring from the tenant's place below the load bound, skipping
        ``exclude``; None when no replica is left."""
        excluded = set(exclude)
        with self._lock:
            candidates = [r for r in self._order(tenant) if r not in excluded]
            if not candidates:
                return None
            bound = self.bound()
            chosen = next((r for r in candidates if self.loads[r] < bound), None)
            if chosen is None:  # only when exclude left out the replicas with room
                chosen = min(candidates, key=lambda r: self.loads[r])
            self.loads[chosen] += 1
            return chosen

    def release(self, replica: Hashable) -> None:
        with self._lock:
            if replica in self.loads and self.loads[replica] > 0:
                self.loads[replica] -= 1
