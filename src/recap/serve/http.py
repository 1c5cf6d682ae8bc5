"""The connection layer under the app: uvicorn's h11 protocol with a deadline for headers,
and uvicorn's server with a shutdown that answers every request.

uvicorn has no header timeout: a connection that has sent part of its request line or headers
(its keep-alive timer stops at the first byte) is held for ever, before the app sees a request,
so neither ``--request-timeout`` nor ``--max-queue`` applies to it, and a client that trickles
a few header bytes on many connections ("slowloris") holds as many file descriptors. Here the
headers of every request must be complete within ``header_timeout`` seconds of the
connection's opening (or of the previous response on a kept-alive connection), or the
connection is closed. The body that follows is bounded by the app (size, and
``--request-timeout`` for its arrival).

uvicorn has no write timeout either: a client that stops reading a response (a stream it
never consumes) blocks the send once the socket's and the transport's buffers are full, and
the connection is held for ever after its request has ended. Here a connection whose writes
stay paused (buffer full) for ``write_timeout`` seconds is aborted.

uvicorn's own SIGTERM handling waits for the connections to close, then cancels the handlers
still running: a stream is cut without its last event, a waiting request gets nothing or a
plain 500. `DrainingServer` first drains the engine (new requests and waiting ones 503, the
running ones ``grace`` seconds to finish, then ended with a 503 event) and gives uvicorn a
longer grace, so every client gets a final answer before any handler is cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0
"""Seconds a client has to send a request's line and headers (nginx's default is 60)."""
WRITE_TIMEOUT = 30.0
"""Seconds a response may wait for a client that stopped reading (nginx's send_timeout is 60)."""
SHUTDOWN_GRACE = 30.0
"""Seconds the requests in flight get to finish after SIGTERM (``recap serve --shutdown-grace``)."""
ANSWER_MARGIN = 5.0
"""uvicorn's own grace exceeds the engine's by this much: time for the final events of the
requests the engine ended to reach their clients before uvicorn cancels any handler."""


def header_deadline_protocol(header_timeout: float = HEADER_TIMEOUT,
                             write_timeout: float = WRITE_TIMEOUT) -> type[H11Protocol]:
    """uvicorn's h11 protocol class (``uvicorn.run(..., http=...)``) closing connections
    whose request headers are not complete ``header_timeout`` seconds after they could start,
    and aborting those whose client has not read for ``write_timeout`` seconds with the
    write buffer full."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _stalled: asyncio.TimerHandle | None = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()
            super().data_received(data)
            if not self._between_requests():  # the headers are in: the app bounds the rest
                self._disarm()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(write_timeout, self._not_reading)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def _unstall(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _not_reading(self) -> None:
            """abort, not close: close would wait to flush the buffer the client never reads;
            the app then sees a disconnect and its stream ends (the request is cancelled)."""
            self._stalled = None
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first exit signal (SIGTERM, Ctrl-C) drains ``drain(grace)``
    before uvicorn's own shutdown: the engine refuses new requests with 503, answers the
    waiting ones 503 and gives the running ones ``grace`` seconds, after which it ends them
    with a 503 event; uvicorn waits ``grace`` + `ANSWER_MARGIN` seconds for the connections
    to close, so no handler is cancelled before its client has its answer."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], None], grace: float = SHUTDOWN_GRACE):
        config.timeout_graceful_shutdown = grace + ANSWER_MARGIN
        super().__init__(config)
        self.grace = grace
        self._drain = drain
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining:
            self._draining = True
            # on a thread of its own: this signal handler may have interrupted the loop's thread
            # inside the engine's lock, which draining takes
            threading.Thread(target=self._drain, args=(self.grace,), name="recap-drain", daemon=True).start()
        super().handle_exit(sig, frame)
