"""Predicted time to first token of a request on a worker (issue #32, docs/objectives.md).

A worker reports its engine's step-cost model (`WorkerCapacity.step_cost`: seconds per scaled
unit of each of `STEP_COST_FEATURES`, fitted online from its own steps, workers/step_budget.py),
its prefill backlog by class and its per-step token budget. A new request's first token comes at
the end of the step that prefills its last prompt token; before it, the engine prefills what is
ahead of it: the backlog of its own and more urgent classes (the engine serves by class, then
arrival). So the prediction is the time of the steps that prefill `ahead + own uncached prompt`
tokens in budget-sized chunks, each step also decoding the worker's running streams.

A request the gateway must hold because no worker has room for it (dispatch/slots.py: each
worker's own queue is kept short) first waits for room: `RoomPace` measures how fast room appears
for a model's held jobs, and the dispatcher adds one such gap per job held ahead of it, and one for
itself, before the worker-side prediction. Without it, an overloaded worker's predictions were half
the TTFT observed (docs/lab/notebook.md, 2026-12-06): the wait for room dominated.

Each step also reads the decoding streams' KV (`decode_context_tokens`, as the worker last
reported it, held constant though the streams grow and finish).

A request sent to a busy engine waits for the step it is in to end. An engine host reports between
two steps (after each step that changed its load), so the step in progress began about when its
last report came: `WorkerLoad.since_report` seconds ago. That step, predicted from the report (the
decoding streams and a budget's chunk of the backlog, most urgent first), has its rest still to
run, and the part of the backlog it prefills is no longer ahead. A report older than that step
(no change to report, as in steady decoding) leaves the phase of the same step repeated: the rest
of the step is `step - since_report % step`, nothing taken off the backlog.

The jobs sent to the worker since its last report (on the wire, or received and not reported yet:
`sent - num_received` of them, the link's latest) are ahead too, by their class
(`WorkerLoad.unreported`): a request sent right after another long prompt waits for its prefill.

Left out: a wait for a free sequence slot (optimistic), the backlog's own prefix-cache hits
(pessimistic). Torch-free and pure: the gateway asks it per candidate worker per request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sluice.protocol import STEP_COST_FEATURES, STEP_COST_SCALES, Priority, WorkerCapacity


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the prediction needs of one worker (from its `WorkerCapacity`)."""

    step_cost: tuple[float, ...]  # seconds per scaled unit of each of STEP_COST_FEATURES
    prefill_backlog: tuple[int, ...]  # tokens still to prefill, by Priority value
    decode_rows: int  # streams decoding in every step
    step_tokens: int  # the engine's token budget per step
    decode_context: int = 0  # KV tokens those streams read in every step
    since_report: float | None = None  # seconds since this report came (None: the step in progress is not counted)
    unreported: tuple[int, ...] = ()  # prompt tokens of the jobs sent since, not in the report yet, by Priority value

    @classmethod
    def of(cls, capacity: WorkerCapacity, since_report: float | None = None,
           unreported: tuple[int, ...] = ()) -> WorkerLoad | None:
        """None when the worker cannot be predicted (cold cost model, or an older worker)."""
        if len(capacity.step_cost) != len(STEP_COST_FEATURES) or capacity.max_num_batched_tokens < 1:
            return None
        return cls(capacity.step_cost, capacity.prefill_backlog, capacity.num_running,
                   capacity.max_num_batched_tokens, capacity.decode_context_tokens, since_report, unreported)

    def ahead(self, priority: Priority) -> int:
        """Backlog tokens served before a new request of `priority` (its class and more urgent):
        the reported ones and those of the jobs sent since."""
        return self.reported_ahead(priority) + sum(self.unreported[: int(priority) + 1])

    def reported_ahead(self, priority: Priority) -> int:
        """The part of `ahead` the worker's report holds."""
        return sum(self.prefill_backlog[: int(priority) + 1])

    def step_in_progress(self, priority: Priority) -> tuple[float, int]:
        """(seconds left of the step the worker is in, the tokens ahead of a new request of
        `priority` that step prefills); (0, 0) when it is idle or the report's age is not known."""
        backlog = sum(self.prefill_backlog)
        if self.since_report is None or (backlog == 0 and self.decode_rows == 0):
            return 0.0, 0
        chunk = min(backlog, self.step_tokens)
        step = step_seconds(self.step_cost, prefill_tokens=chunk, start=0, decode_rows=self.decode_rows,
                            decode_context=self.decode_context)
        if step <= 0.0:
            return 0.0, 0
        if self.since_report < step:  # the step the report was sent before
            return step - self.since_report, min(self.reported_ahead(priority), chunk)
        return step - self.since_report % step, 0  # a later one, of the same shape as far as is known


def step_seconds(step_cost: tuple[float, ...], *, prefill_tokens: int, start: int, decode_rows: int,
                 decode_context: int = 0, fixed: bool = True) -> float:
    """One step's predicted seconds: a prefill chunk of `prefill_tokens` at position `start`, plus
    `decode_rows` decodes reading `decode_context` KV tokens (the features of workers/step_budget.py's
    StepShape, in its units); `fixed=False`: without the per-step fixed cost (a second chunk in the
    same step)."""
    pairs = prefill_tokens * (start + (prefill_tokens + 1) / 2)
    raw = (1.0 if fixed else 0.0, prefill_tokens, decode_rows, start + prefill_tokens + decode_context, 0.0, pairs)
    return max(0.0, sum(c * x / s for c, x, s in zip(step_cost, raw, STEP_COST_SCALES, strict=True)))


def predict_ttft(load: WorkerLoad, *, priority: Priority, prompt_tokens: int, cached_tokens: int = 0,
                 queued_ahead: int = 0, sent_now: bool = True) -> float:
    """Seconds until the first token of a request of `priority` with `prompt_tokens` tokens, of which
    the worker holds `cached_tokens` in its prefix cache; `queued_ahead`: tokens of requests the
    gateway holds that will reach this worker before it. `sent_now`: it reaches the worker now,
    and waits for the rest of the step in progress there (False: at some later instant, whose
    step is not known).

    The backlog ahead is prefilled as one prompt from position 0, then this prompt from
    `cached_tokens`, in chunks of the step budget. At least one step (a fully cached prompt still
    computes its last token)."""
    budget = load.step_tokens
    cached = max(0, min(cached_tokens, prompt_tokens - 1))
    seconds, done = load.step_in_progress(priority) if sent_now else (0.0, 0)
    segments = ((load.ahead(priority) - done + queued_ahead, 0), (max(1, prompt_tokens - cached), cached))
    room = budget  # left in the current step
    chunk = 0  # tokens already in the current step
    for tokens, start in segments:
        while tokens > 0:
            take = min(tokens, room)
            # A step's fixed and decode cost is counted once, with its first chunk.
            first = chunk == 0
            seconds += step_seconds(load.step_cost, prefill_tokens=take, start=start,
                                    decode_rows=load.decode_rows if first else 0,
                                    decode_context=load.decode_context if first else 0, fixed=first)
            tokens -= take
            start += take
            room -= take
            chunk += take
            if room == 0:
                room, chunk = budget, 0
    return seconds


class RoomPace:
    """How fast a model's workers make room for the jobs held for them at the gateway: the mean of
    the last `window` gaps between a send that left jobs of the model held and the model's next
    send. A send that left none held starts no gap, so an idle stretch is never counted as slow
    room. The dispatcher owns one and tells it of every send (dispatch/dispatcher.py)."""

    def __init__(self, window: int = 32) -> None:
        self._window = window
        self._gap_from: dict[str, float] = {}  # model -> when its last send left jobs held
        self._gaps: dict[str, deque[float]] = {}

    def sent(self, model: str, now: float, *, left_held: bool) -> None:
        """A job of `model` went to a worker at `now` (monotonic seconds); `left_held`: jobs of
        the model are still held after it."""
        start = self._gap_from.pop(model, None)
        if start is not None:
            self._gaps.setdefault(model, deque(maxlen=self._window)).append(max(0.0, now - start))
        if left_held:
            self._gap_from[model] = now

    def seconds_per_job(self, model: str) -> float | None:
        """The mean gap between sends while jobs of `model` were held; None before any."""
        gaps = self._gaps.get(model)
        return sum(gaps) / len(gaps) if gaps else None


__all__ = ["RoomPace", "WorkerLoad", "predict_ttft", "step_seconds"]
