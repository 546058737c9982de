"""The SSE stream of an answer of n > 1 choices: the choices' chunks interleaved as they come.

Each choice is a request of its own (generation/choices.py) with its own `Framer`, whose chunks
carry its index; a chunk goes out as soon as its choice's delta arrives, so the choices interleave
by arrival, each ending with its own finish_reason (as OpenAI's). Once every choice has ended and
its quota is settled: one usage chunk for the whole answer (prompt once, completions summed) when
`stream_options.include_usage`, then `[DONE]`. A choice that fails ends the stream with its error
event and the other choices are aborted; so does the client going away.

Unlike a single-request stream (streams/hub.py) such a stream has no log: it is not resumable
(`Idempotency-Key`, `X-Sluice-Resumable`), and it ends with the connection or the replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from sluice.gateway.generation.choices import answer_usage
from sluice.gateway.generation.flight import Flight, RequestTimedOut
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.streams.frames import DONE, Framer
from sluice.protocol import FinishReason, RequestDelta

log = logging.getLogger(__name__)

_ENDED = b""  # a choice's end, in the queue of events (no event is empty)


class _Failed(bytes):
    """The event that ends the whole stream (a choice failed): nothing follows it."""


class ChoicesStream:
    """An answer's events (module docstring), for `SSEResponse`. `aclose()` aborts the choices not
    finished whether or not the events were read (a client gone before the first byte)."""

    def __init__(self, flights: list[Flight], tokenizer: ModelTokenizer) -> None:
        self._flights = flights
        self._events = _events(flights, tokenizer)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            _abort_unfinished(self._flights)


def _abort_unfinished(flights: list[Flight]) -> None:
    for flight in flights:  # the others of a failed answer, or all when the client went away
        flight.finish(aborted=flight.state.finish_reason is None)


async def _events(flights: list[Flight], tokenizer: ModelTokenizer) -> AsyncGenerator[bytes, None]:
    """The flights are listened to from the first read."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    framers = [Framer(flight.state, tokenizer, index=i) for i, flight in enumerate(flights)]
    for framer in framers:  # every choice's role chunk first, then their deltas as they come
        opening = framer.opening()
        if opening is not None:
            queue.put_nowait(opening)
    for flight, framer in zip(flights, framers, strict=True):
        flight.listen(_listener(framer, queue))
    watchers = [asyncio.ensure_future(_watch(flight, framer, queue))
                for flight, framer in zip(flights, framers, strict=True)]
    try:
        running = len(flights)
        while running:
            events = [await queue.get()]
            while not queue.empty():  # what came meanwhile goes out in one write
                events.append(queue.get_nowait())
            running -= events.count(_ENDED)
            failed = next((e for e in events if isinstance(e, _Failed)), None)
            if failed is not None:  # up to and including the failure's event
                yield b"".join(events[:events.index(failed) + 1])
                return
            yield b"".join(events)
        for flight in flights:
            flight.finish()
        for flight in flights:
            await flight.settled()  # the client's next request finds the whole answer ended
        usage = framers[0].usage(answer_usage([flight.state for flight in flights]))
        yield DONE if usage is None else usage + DONE
    finally:
        for watcher in watchers:
            watcher.cancel()
        _abort_unfinished(flights)


def _listener(framer: Framer, queue: asyncio.Queue[bytes]) -> Callable[[RequestDelta], None]:
    """A choice's deltas framed into the queue; its error as the event that ends the stream."""

    def on_delta(delta: RequestDelta) -> None:
        if delta.finish_reason is FinishReason.ERROR:
            queue.put_nowait(_Failed(framer.error()))
        else:
            framer.frames(delta, lambda frame, _chars, _finish: queue.put_nowait(frame))

    return on_delta


async def _watch(flight: Flight, framer: Framer, queue: asyncio.Queue[bytes]) -> None:
    """Queues the choice's end, or the event that ends the stream when it timed out or its
    delta could not be framed."""
    try:
        await flight.ended()
    except RequestTimedOut as exc:
        queue.put_nowait(_Failed(Framer.failed(exc)))
    except Exception:
        log.exception("stream %s: its events could not be written", flight.request_id)
        queue.put_nowait(_Failed(framer.error()))
    else:
        queue.put_nowait(_ENDED)
