"""Prometheus metrics of one server (its own registry, so tests can run several servers)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self, queue_depth: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("recap_requests", "Chat completion requests by outcome", ["status"], registry=r)
        self.completion_tokens = Counter("recap_completion_tokens", "Tokens generated", registry=r)
        self.abandoned_tokens = Counter("recap_abandoned_tokens", "Tokens generated for requests that ended "
                                        "without an answer (cancelled, timed out, failed)", registry=r)
        self.prompt_tokens = Counter("recap_prompt_tokens", "Prompt tokens processed", registry=r)
        self.drafted_tokens = Counter("recap_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("recap_accepted_tokens", "Draft tokens accepted", registry=r)
        self.tau = Histogram("recap_tau", "Tokens per verification step, per request", registry=r,
                             buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12))
        self.latency = Histogram("recap_request_seconds", "Time from arrival to the last token", registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.first_token = Histogram("recap_time_to_first_token_seconds", "Time from arrival to the first token",
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.memory_saves_coalesced = Counter("recap_memory_saves_coalesced", "Tenant memory saves replaced by "
                                              "a newer one of the same tenant before being written", registry=r)
        self.queue_depth = Gauge("recap_queue_depth", "Requests waiting for the decoder", registry=r)
        self.queue_depth.set_function(queue_depth)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
