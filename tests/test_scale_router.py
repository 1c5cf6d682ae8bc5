"""`recap.serve.router.TenantRouter`: consistent hashing with bounded loads (no Ray needed)."""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.serve.router import TenantRouter

tenants = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=12)
replica_counts = st.integers(min_value=1, max_value=6)


def _names(n: int) -> list[str]:
    return [f"replica-{i}" for i in range(n)]


@given(replica_counts, st.lists(tenants, min_size=1, max_size=30), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_owner_is_the_same_whatever_the_order_replicas_join(n, names, rng):
    shuffled = _names(n)
    rng.shuffle(shuffled)
    first, second = TenantRouter(_names(n)), TenantRouter(shuffled)
    for tenant in names:
        assert first.owner(tenant) == second.owner(tenant)
        assert sorted(first.order(tenant)) == _names(n)  # every replica once


@given(replica_counts, st.lists(tenants, min_size=1, max_size=30))
@settings(max_examples=60, deadline=None)
def test_an_idle_ring_sends_each_tenant_to_its_owner(n, names):
    router = TenantRouter(_names(n))
    for tenant in names:
        replica = router.acquire(tenant)
        assert replica == router.owner(tenant)
        router.release(replica)
    assert set(router.loads.values()) == {0}


@given(replica_counts, st.floats(min_value=1.0, max_value=2.0),
       st.lists(st.tuples(st.booleans(), st.sampled_from(["a", "b", "c", "hot", "x1", "x2"])), max_size=80))
@settings(max_examples=100, deadline=None)
def test_no_replica_goes_past_the_bound(n, factor, operations):
    """After every placement the chosen replica holds at most ceil(c * in-flight / replicas),
    and loads always equal the requests placed minus those released."""
    router = TenantRouter(_names(n), load_factor=factor)
    held: list[str] = []
    for place, tenant in operations:
        if place or not held:
            replica = router.acquire(tenant)
            held.append(replica)
            total = sum(router.loads.values())
            assert router.loads[replica] <= math.ceil(factor * total / n)
            # it took the first replica on the tenant's ring with room
            order = router.order(tenant)
            assert all(router.loads[r] >= math.ceil(factor * total / n) for r in order[:order.index(replica)])
        else:
            router.release(held.pop(0))
        assert Counter(held) == Counter({r: c for r, c in router.loads.items() if c})


def test_a_hot_tenant_spills_to_the_next_replica_on_its_ring():
    router = TenantRouter(_names(3), load_factor=1.25)
    order = router.order("hot")
    placed = [router.acquire("hot") for _ in range(9)]
    assert placed[0] == order[0]
    assert set(placed) == set(order)  # spilled along the ring instead of queueing on one replica
    assert max(Counter(placed).values()) <= math.ceil(1.25 * 9 / 3)
    first_spill = next(i for i, r in enumerate(placed) if r != order[0])
    assert placed[first_spill] == order[1]


def test_a_replica_with_free_lanes_is_not_hot():
    router = TenantRouter(_names(3), min_bound=4)
    owner = router.owner("hot")
    placed = [router.acquire("hot") for _ in range(5)]
    assert placed[:4] == [owner] * 4 and placed[4] != owner  # the fifth would wait: it spills
    assert router.bound() == 4


@given(st.integers(min_value=2, max_value=6), st.lists(tenants, min_size=1, max_size=40), st.data())
@settings(max_examples=60, deadline=None)
def test_removing_a_replica_moves_only_its_tenants(n, names, data):
    router = TenantRouter(_names(n))
    before = {tenant: router.owner(tenant) for tenant in names}
    gone = data.draw(st.sampled_from(_names(n)))
    router.remove(gone)
    for tenant, owner in before.items():
        now = router.owner(tenant)
        assert now != gone
        if owner != gone:
            assert now == owner
    assert router.acquire(names[0], exclude=router.replicas) is None


def test_exclude_is_respected_and_an_empty_ring_gives_none():
    router = TenantRouter(_names(2))
    owner = router.owner("t")
    other = router.acquire("t", exclude=[owner])
    assert other is not None and other != owner
    assert router.acquire("t", exclude=_names(2)) is None
    assert TenantRouter([]).acquire("t") is None
    with pytest.raises(ValueError):
        TenantRouter(_names(2), load_factor=0.5)
    with pytest.raises(ValueError):
        router.add("replica-0")


def test_tenants_spread_over_the_replicas():
    router = TenantRouter(_names(4))
    owners = Counter(router.owner(f"tenant-{i}") for i in range(2000))
    assert set(owners) == set(_names(4))
    assert all(0.12 < count / 2000 < 0.40 for count in owners.values()), owners


def test_a_scaled_engine_refuses_with_503_reasons_when_it_cannot_take_jobs():
    """Shutting down, or every replica dead: `Unavailable` (503 with its code), not `QueueFull`'s
    429 "retry later"; a full queue stays a plain `QueueFull`."""
    from recap.serve.engine import Job, NoReplica, QueueFull, ShuttingDown, Unavailable
    from recap.serve.scale import ScaledEngine

    engine = ScaledEngine({"r0": object()}, max_batch={"r0": 1}, max_queue=0)
    job = Job(tenant="t", inputs=None, max_tokens=1, emit=lambda event: None)
    try:
        with pytest.raises(QueueFull) as full:
            engine.submit(job)
        assert not isinstance(full.value, Unavailable)
        engine.dead.add("r0")
        with pytest.raises(NoReplica):
            engine.submit(job)
        engine._accepting = False
        with pytest.raises(ShuttingDown):
            engine.submit(job)
    finally:
        engine._stop.set()


def test_a_draining_scaled_engine_ends_its_requests_with_503_after_the_grace(monkeypatch):
    """`ScaledEngine.drain` (SIGTERM with --replicas): a new request is refused with
    `ShuttingDown`; the one in flight runs through the grace, then is cancelled on its
    replica and answered 503 ``shutting_down`` (not the 499 of a client that left). Fake Ray
    modules and replica: no cluster."""
    import sys
    import threading
    import types

    from recap.serve.engine import Job, ShuttingDown
    from recap.serve.scale import ScaledEngine

    ray = types.ModuleType("ray")
    exceptions = types.ModuleType("ray.exceptions")
    exceptions.ActorUnavailableError = exceptions.RayActorError = type("Never", (Exception,), {})
    ray.exceptions, ray.get = exceptions, (lambda ref: ref)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", exceptions)
    cancelled = threading.Event()

    class Handle:
        def __init__(self):
            self.decode = types.SimpleNamespace(remote=self._decode)
            self.cancel = types.SimpleNamespace(options=lambda **_: types.SimpleNamespace(
                remote=lambda request_id: cancelled.set()))

        def _decode(self, *args):
            def events():  # text until the front cancels the request on this replica
                while not cancelled.wait(0.01):
                    yield {"type": "text", "text": "x"}
                yield {"type": "error", "message": "the request was cancelled", "status": 499}
            return events()

    engine = ScaledEngine({"r0": Handle()}, max_batch={"r0": 1})
    events: list[dict] = []
    try:
        job = Job(tenant="t", inputs=None, max_tokens=1, emit=events.append)
        engine.submit(job)
        deadline = time.monotonic() + 30
        while not events:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        engine.drain(0.2)
        with pytest.raises(ShuttingDown):
            engine.submit(Job(tenant="t", inputs=None, max_tokens=1, emit=lambda event: None))
        while events[-1]["type"] == "text":
            assert time.monotonic() < deadline + 30, "the request was never ended"
            time.sleep(0.01)
    finally:
        engine._stop.set()
    assert events[-1]["status"] == 503 and events[-1]["code"] == "shutting_down", events[-1]


def test_failover_kills_the_replica_it_gave_up_on_before_retrying(monkeypatch):
    """Ray reports the tenant's replica unavailable mid-request (it may still be alive): the
    front kills it before the request runs again on the other replica, which gets the same
    request id (the memory learns from a request once). Fake Ray modules: no cluster."""
    import sys
    import types

    from recap.serve.engine import Job
    from recap.serve.scale import ScaledEngine

    calls: list[tuple] = []
    exceptions = types.ModuleType("ray.exceptions")

    class ActorUnavailableError(Exception):
        pass

    class RayActorError(Exception):
        pass

    exceptions.ActorUnavailableError, exceptions.RayActorError = ActorUnavailableError, RayActorError
    ray = types.ModuleType("ray")
    ray.exceptions = exceptions
    ray.get = lambda ref: ref
    ray.kill = lambda handle, no_restart=False: calls.append(("kill", handle.name, no_restart))
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", exceptions)

    class Handle:
        def __init__(self, name: str):
            self.name, self.unavailable = name, False
            self.decode = types.SimpleNamespace(remote=self._decode)

        def _decode(self, request_id, tenant, *args):
            calls.append(("decode", self.name, request_id))

            def events():
                if self.unavailable:
                    raise ActorUnavailableError("unreachable")
                yield {"type": "done", "text": "the answer"}

            return events()

    handles = {name: Handle(name) for name in _names(2)}
    engine = ScaledEngine(handles, max_batch=dict.fromkeys(handles, 1))
    owner = engine.router.owner("t")
    other = next(name for name in handles if name != owner)
    handles[owner].unavailable = True
    events: list[dict] = []
    try:
        engine._drive(Job(tenant="t", inputs=None, max_tokens=1, emit=events.append))
    finally:
        engine._stop.set()
    assert events == [{"type": "done", "text": "the answer"}]
    request_id = calls[0][2]
    assert calls == [("decode", owner, request_id), ("kill", owner, True), ("decode", other, request_id)]
    assert engine.dead == {owner} and engine.retried == 1
