"""``recap serve --replicas N`` / ``--ray-address ADDR``: one HTTP front, N decoding replicas on Ray.

The front is the single server's FastAPI app (`recap.serve.app.create_app`: the same API,
keys, limits, errors and metrics); only its decoder differs: `ScaledEngine` hands each
prepared request to a replica chosen by `recap.serve.router.TenantRouter` (a tenant stays on
one replica unless it is hot) and forwards the replica's events. A replica (`Replica`, a Ray
actor) is the single server's `Engine` over `recap.serve.shared.SharedTenantStreams`, whose
file locks and versions keep the memory folder right whichever replica a request lands on.

A replica that dies (or that Ray reports unavailable) with a request in flight has it run
again once on another replica, unless the request is streamed and its text had started: that
stream ends with an error event (a stream cannot take text back; a non-streamed answer is
only the final event, and greedy or seeded decoding gives it again). The replica given up on
is killed first (an unavailable one may still be alive: it must neither decode nor save any
more), leaves the ring, so new requests go to the survivors, and is not restarted. A request
keeps one id across its attempts; a replica's save lists it in the tenant's file, so a
replica that died between its save and its last event leaves the retry nothing to learn
(`recap.serve.shared.locked_events`): a request is learned from, and counted, once.

Only this module imports Ray, and only once `connect` runs (``recap serve --replicas`` or
``--ray-address``): a private instance must be told before Ray's first import to keep to the
loopback interface (`connect`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from recap.errors import InputError
from recap.serve.engine import SHUTTING_DOWN, Engine, Job, NoReplica, QueueFull, ShuttingDown
from recap.serve.router import TenantRouter
from recap.serve.shared import FINAL, SharedTenantStreams, locked_events

log = logging.getLogger("recap.serve")
WATCH_S = 0.1
"""How often the front looks for cancelled requests (client gone) to tell their replicas."""


@dataclass
class ReplicaSpec:
    """What every replica loads and how it decodes (sent to each replica)."""

    model: str
    dtype: str = "float32"
    kernels: str = "auto"
    weights: str = "auto"
    cost_profile: Any = "auto"
    threads: int | None = None
    method: str = "recap"
    memory_dir: str | None = None
    memory_rows: int | None = 16384
    max_queue: int = 64
    max_batch: int | None = None
    shared_budget: bool = True
    use_lock: bool = True
    """False only in the tests' negative control: replicas then lose each other's updates."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set in the replica before it loads the model."""


class Replica:
    """One decoding process: the model, an `Engine`, the tenants' shared streams (a Ray actor)."""

    def __init__(self, spec: ReplicaSpec):
        os.environ.update(spec.env)
        import torch

        from recap.models import load

        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.target = load(spec.model, dtype=spec.dtype, kernels=spec.kernels, weights=spec.weights)
        self.target.use_cost_profile(spec.cost_profile)
        self.tenants = SharedTenantStreams(spec.method, self.target.vocab_size, spec.memory_dir, spec.memory_rows,
                                           use_lock=spec.use_lock)
        self.engine = Engine(self.target, self.tenants, max_queue=spec.max_queue, max_batch=spec.max_batch,
                             shared_budget=spec.shared_budget)
        self._jobs: dict[str, Job] = {}

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "max_batch": self.engine.batch.max_batch}

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "reloads": self.tenants.reloads, "requests": dict(self.tenants.requests),
                "versions": dict(self.tenants.versions)}

    def cancel(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.cancel()

    def decode(self, request_id: str, tenant: str, inputs, max_tokens: int, sampling, seconds: float,
               stop: tuple[str, ...] = ()):
        """The request's events, as `Engine` emits them (a Ray streaming generator). The
        tenant's lock is taken before the request is queued and let go after its save, just
        before its final event. ``request_id`` is the same for every attempt of one request
        (its save lists it: a request is learned from once)."""
        job = Job(tenant=tenant, inputs=inputs, max_tokens=max_tokens, sampling=sampling, emit=lambda event: None,
                  deadline=time.monotonic() + seconds, stop=stop, request_id=request_id)
        self._jobs[request_id] = job
        try:
            yield from locked_events(self.engine, self.tenants, job)
        finally:
            self._jobs.pop(request_id, None)

    def shutdown(self, timeout: float = 30.0) -> None:
        self.engine.shutdown(timeout)


class ScaleError(InputError):
    """The replicas cannot be started (one line for the command line)."""


CONTROL = "control"
"""The replicas' concurrency group for everything but requests."""


def control(handle, method: str):
    """A replica's control method (`CONTROL` group), ready for ``.remote()``."""
    return getattr(handle, method).options(concurrency_group=CONTROL)


class _Batch:
    """What the app's /health reads from an engine's batch."""

    def __init__(self, engine: ScaledEngine):
        self._engine = engine

    @property
    def running(self) -> list[Job]:
        return [job for job, _, _ in list(self._engine._running.values())]

    @property
    def max_batch(self) -> int:
        return self._engine.max_batch


class ScaledEngine:
    """The front's decoder: `Engine`'s interface (submit, depth, busy, shutdown) over replicas."""

    def __init__(self, replicas: dict[str, Any], *, max_batch: dict[str, int], max_queue: int = 64,
                 on_finish=None, owns_ray: bool = False, load_factor: float = 1.25):
        self.handles = dict(replicas)
        self.replica_batch = dict(max_batch)
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.owns_ray = owns_ray
        # a replica is hot once it has more requests than it decodes at once (and than its share)
        self.router = TenantRouter(self.handles, load_factor=load_factor, min_bound=min(self.replica_batch.values()))
        self.batch = _Batch(self)
        self.dead: set[str] = set()
        self.retried = 0
        self._running: dict[int, tuple[Job, str, str]] = {}
        """id(job) -> (job, replica, request id) for requests on a replica now."""
        self._cancel_sent: dict[str, float] = {}
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="recap-scale-watch", daemon=True)
        self._watcher.start()

    @property
    def alive(self) -> list[str]:
        return [name for name in self.handles if name not in self.dead]

    @property
    def max_batch(self) -> int:
        return sum(self.replica_batch[name] for name in self.alive)

    @property
    def in_flight(self) -> int:
        return len(self._threads)

    @property
    def depth(self) -> int:
        """Requests beyond what the live replicas decode at once (an estimate of those waiting)."""
        return max(0, self.in_flight - self.max_batch)

    @property
    def busy(self) -> bool:
        return bool(self._threads)

    def health(self) -> dict[str, Any]:
        return {"replicas": len(self.alive), "replicas_dead": len(self.dead),
                "replica_load": {name: self.router.loads.get(name, 0) for name in self.alive}}

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if not self.alive:
                raise NoReplica("no replica is running")
            if self.depth >= self.max_queue:
                raise QueueFull(f"{self.depth} requests are already waiting")
            thread = threading.Thread(target=self._drive, args=(job,), name="recap-scale-request", daemon=True)
            self._threads.add(thread)
        thread.start()

    # ------------------------------------------------------------------ one request
    def _drive(self, job: Job) -> None:
        final: dict[str, Any] = {"type": "error", "message": "internal server error", "status": 500}
        tried: list[str] = []
        request_id = secrets.token_hex(16)  # one for every attempt: the memory learns from the request once
        try:
            while True:
                if job.cancelled.is_set():
                    final = {"type": "error", "message": "the request was cancelled", "status": 499}
                    break
                replica = self.router.acquire(job.tenant, exclude=tried)
                if replica is None:
                    final = {"type": "error", "message": "no replica is running", "status": 503}
                    break
                tried.append(replica)
                started, final = self._attempt(job, replica, request_id)
                if final is not None:
                    break
                # the replica died: once more, elsewhere, unless a stream had shown text (a non-streamed
                # answer is only the final event, and a greedy or seeded decode gives it again)
                if (started and job.streamed) or len(tried) > 1:
                    final = {"type": "error", "message": "the replica decoding this request failed", "status": 503}
                    break
                self.retried += 1
                log.warning("replica %s failed with the request in flight; running it again on another", replica)
        except Exception:  # noqa: BLE001 - the request must be answered
            log.exception("request failed")
        finally:
            if self._grace_over and final.get("status") == 499:  # ended by the shutdown, not by its client
                final = dict(SHUTTING_DOWN)
            job.emit(final)
            if self.on_finish is not None:
                self.on_finish(job, final)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _attempt(self, job: Job, replica: str, request_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Run the job on one replica: (whether text was sent, the final event; None when the
        replica died or became unreachable: it is then killed, before any retry)."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        started = False
        with self._lock:
            self._running[id(job)] = (job, replica, request_id)
        try:
            seconds = max(0.0, job.deadline - time.monotonic())
            stream = self.handles[replica].decode.remote(request_id, job.tenant, job.inputs, job.max_tokens,
                                                         job.sampling, seconds, job.stop)
            for ref in stream:
                event = ray.get(ref)
                if event["type"] in FINAL:
                    return started, event
                started = True
                job.emit(event)
            return started, {"type": "error", "message": "the replica ended the request without an answer",
                             "status": 500}
        except (RayActorError, ActorUnavailableError) as error:
            log.error("replica %s is gone (%s); new requests go to the others", replica, type(error).__name__)
            self._kill(replica)
            self._mark_dead(replica)
            return started, None
        finally:
            with self._lock:
                self._running.pop(id(job), None)
                self._cancel_sent.pop(request_id, None)
            self.router.release(replica)

    def _kill(self, replica: str) -> None:
        """Kill a replica given up on: one Ray reports unavailable may still be alive, and must
        not go on decoding and saving while its requests run again elsewhere."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.handles[replica], no_restart=True)

    def _mark_dead(self, replica: str) -> None:
        with self._lock:
            if replica in self.dead:
                return
            self.dead.add(replica)
        self.router.remove(replica)

    def _watch(self) -> None:
        """Tell replicas about cancelled requests (client gone, shutdown); their decoders stop at the next step."""
        while not self._stop.wait(WATCH_S):
            now = time.monotonic()
            with self._lock:  # sent again each second: one may arrive before its request does
                todo = [(replica, rid) for job, replica, rid in self._running.values()
                        if job.cancelled.is_set() and now - self._cancel_sent.get(rid, -1.0) >= 1.0]
                self._cancel_sent.update((rid, now) for _, rid in todo)
            for replica, rid in todo:
                with contextlib.suppress(Exception):
                    control(self.handles[replica], "cancel").remote(rid)

    # ------------------------------------------------------------------ shutdown
    def drain(self, grace: float) -> None:
        """Begin shutting down without waiting (`recap.serve.http.DrainingServer`, on SIGTERM):
        new requests get 503 ``shutting_down``; those in flight (decoding or waiting on a
        replica) get ``grace`` seconds, then are cancelled and answered 503 ``shutting_down``."""
        with self._lock:
            self._accepting = False
        timer = threading.Timer(grace, self._end_grace)
        timer.daemon = True
        timer.start()

    def _end_grace(self) -> None:
        with self._lock:
            self._grace_over = True
            running = [job for job, _, _ in self._running.values()]
        for job in running:
            job.cancel()

    _grace_over = False
    """`drain`'s grace has ended: a request cancelled now ends with 503, not 499."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish (cancel them after ``timeout``),
        stop the replicas (every request's memory is saved at its end) and, if this process
        started Ray, Ray."""
        import ray

        with self._lock:
            self._accepting = False
        end = time.monotonic() + timeout
        while self._threads and time.monotonic() < end:
            time.sleep(0.05)
        if self._threads:
            log.warning("the requests in flight did not finish within %.0f s; cancelling them", timeout)
            with self._lock:
                for job, _, _ in self._running.values():
                    job.cancel()
            end = time.monotonic() + timeout
            while self._threads and time.monotonic() < end:
                time.sleep(0.05)
        self._stop.set()
        stops = [control(self.handles[name], "shutdown").remote(5.0) for name in self.alive]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=15)
        for name in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(self.handles[name])
        if self.owns_ray:
            ray.shutdown()


# ----------------------------------------------------------------------------- starting
def connect(address: str | None, *, replicas: int, cpus_per_replica: float) -> bool:
    """Join the cluster at ``address``, or start a private Ray instance that listens on the
    loopback interface only, without dashboard or usage reports (Ray's token authentication,
    on by default since Ray 2.5x, stays on). True when this process started Ray (and must
    stop it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None and "ray" not in sys.modules:
        # Ray's single-machine mode (its default on macOS and Windows): every Ray server binds
        # 127.0.0.1. Read once, when Ray is first imported; the replicas inherit it.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return False
    # "local": always a new instance, never a cluster someone started on this machine (ray start)
    ray.init(address="local", num_cpus=max(1, math.ceil(replicas * cpus_per_replica)), include_dashboard=False,
             log_to_driver=True)
    nodes = {node["NodeManagerAddress"] for node in ray.nodes()}
    if not all(_loopback(ip) for ip in nodes):
        ray.shutdown()
        raise ScaleError(f"the private Ray instance would listen on {', '.join(sorted(nodes))}, not only on "
                         "loopback (Ray was imported before recap could ask it to): start a cluster yourself "
                         "and pass --ray-address")
    return True


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


def start_replicas(spec: ReplicaSpec, replicas: int, *, cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0,
                   timeout: float = 600.0) -> tuple[dict[str, Any], dict[str, int]]:
    """Start ``replicas`` actors and wait until each has loaded its model: (handles, max_batch per replica)."""
    import ray

    # requests (waiting for a lock, queued, decoding) in the default group; cancel, info, stats
    # and shutdown in their own, so they never queue behind requests
    concurrency = spec.max_queue + (spec.max_batch or 8) + 4
    actor = ray.remote(concurrency_groups={CONTROL: 4}, max_concurrency=concurrency)(Replica)
    handles = {f"replica-{i}": actor.options(num_cpus=cpus_per_replica, num_gpus=gpus_per_replica,
                                             max_restarts=0).remote(spec)
               for i in range(replicas)}
    names = list(handles)
    refs = [control(handles[name], "info").remote() for name in names]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    try:
        if len(ready) < len(refs):
            raise ScaleError(f"only {len(ready)} of {replicas} replicas started within {timeout:.0f} s "
                             "(does the cluster have the CPUs/GPUs they ask for?)")
        try:
            infos = dict(zip(names, ray.get(refs)))
        except ray.exceptions.RayError as error:  # a replica could not load the model
            reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
            raise ScaleError(f"a replica failed to start: {reason}") from None
    except BaseException:
        for handle in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(handle)
        raise
    for name, info in infos.items():
        log.info("%s: pid %s on node %s", name, info["pid"], info["node"][:12])
    return handles, {name: info["max_batch"] for name, info in infos.items()}


def scaled_engine_factory(spec: ReplicaSpec, replicas: int, *, address: str | None = None,
                          cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0, load_factor: float = 1.25):
    """Connect to Ray, start the replicas, and return what `create_app` takes as ``make_engine``."""
    owns = connect(address, replicas=replicas, cpus_per_replica=cpus_per_replica)
    import ray

    try:
        handles, batches = start_replicas(spec, replicas, cpus_per_replica=cpus_per_replica,
                                          gpus_per_replica=gpus_per_replica)
    except BaseException:
        if owns:
            ray.shutdown()
        raise

    def make_engine(on_finish) -> ScaledEngine:
        return ScaledEngine(handles, max_batch=batches, max_queue=spec.max_queue, on_finish=on_finish,
                            owns_ray=owns, load_factor=load_factor)

    return make_engine
