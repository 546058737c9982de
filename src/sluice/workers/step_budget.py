"""The adaptive prefill budget: an online model of an engine step's time, and the rule that sizes
each step's prefill to the inter-token-latency targets of the streams decoding in it (issue #32).

Why: prefill is compute-bound and sets TTFT, decode is bandwidth-bound and sets ITL. In a chunked
step every decoding stream waits for the whole step, prefill chunk included, so the chunk size is
the knob between a new prompt's TTFT and the running streams' ITL. A fixed chunk is right for one
load only; here each step takes the largest prefill budget whose predicted step time keeps every
running latency-sensitive stream inside its ITL target, raised where a prompt with a TTFT
target waiting to prefill would otherwise miss it (`ttft_budget`).

The cost model is linear in what a step computes (`StepShape`): a fixed cost, prefill tokens
(weights x tokens: compute), decode rows (weights read per row: bandwidth), KV tokens attention reads,
speculative verification rows, and prefill attention pairs (quadratic in a long prompt's chunk).
It is fitted from the engine's own measured steps, on CPU and CUDA alike, with no offline profile:
every `REFIT_EVERY` steps a least-squares fit over the last `WINDOW` steps, regularised towards
the previous fit, so a direction the window does not excite (no prefill for a while) keeps what
was learnt before instead of drifting to zero. Pure Python (the scheduler is torch-free).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from sluice.protocol import STEP_COST_FEATURES, STEP_COST_SCALES
from sluice.workers.scheduler_output import SchedulerOutput

# Feature scales: each feature divided by its scale is of order 1 in a typical step, so the fit's
# normal equations are well conditioned and the ridge weight means the same for every coefficient.
# (In the protocol: a worker's coefficients are read by the gateway in the same units.)
FEATURES = STEP_COST_FEATURES
_SCALES = STEP_COST_SCALES
WINDOW = 512  # steps the fit looks at (minutes of a busy engine)
REFIT_EVERY = 16  # steps between fits (a fit costs ~1 ms of Python)
MIN_STEPS = 16  # steps observed before the model is trusted (before: the fixed budget)
RIDGE = 1e-3  # pull towards the previous fit, relative to the data's own weight
ERROR_WINDOW = 2048  # relative prediction errors kept for reporting
OVERRUN_QUANTILE = 0.95  # the ITL cap allows for mixed steps' overrun at this quantile
OVERRUN_WINDOW = 256  # mixed steps (decodes with a prefill chunk) whose overrun is kept
MAX_OVERRUN = 4.0  # a cap never shrinks below a quarter of the target for prediction error
# The step may take this share of the ITL target: host time between steps (sending the tokens,
# the worker's loop) comes on top of the measured step, and a fit is never exact.
ITL_HEADROOM = 0.85


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes, in the units the cost model is linear in."""

    prefill_tokens: int = 0  # tokens of chunks that are not single-token decodes
    decode_rows: int = 0  # decoding requests (each its last token)
    context_tokens: int = 0  # KV tokens attention reads: sum over chunks of start + num_tokens
    verify_rows: int = 0  # speculative draft tokens verified with the decodes
    prefill_pairs: float = 0.0  # prefill attention query x key pairs: sum of n * (start + (n + 1) / 2)

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepShape:
        prefill = decodes = context = verify = 0
        pairs = 0.0
        for chunk in output.chunks:
            drafts = len(chunk.draft_token_ids)
            own = chunk.num_tokens - drafts
            context += chunk.start + chunk.num_tokens
            verify += drafts
            if own == 1 and chunk.sample:
                decodes += 1
            else:
                prefill += own
                pairs += own * (chunk.start + (own + 1) / 2)
        return cls(prefill, decodes, context, verify, pairs)

    def with_prefill(self, tokens: int, start: int) -> StepShape:
        """This step plus a prefill chunk of `tokens` tokens starting at position `start`."""
        return StepShape(self.prefill_tokens + tokens, self.decode_rows, self.context_tokens + start + tokens,
                         self.verify_rows, self.prefill_pairs + tokens * (start + (tokens + 1) / 2))

    def vector(self) -> tuple[float, ...]:
        raw = (1.0, self.prefill_tokens, self.decode_rows, self.context_tokens, self.verify_rows, self.prefill_pairs)
        return tuple(value / scale for value, scale in zip(raw, _SCALES, strict=True))


class StepCostModel:
    """Predicts a step's seconds from its `StepShape`; learns from `observe` (module docstring)."""

    def __init__(self, coefficients: tuple[float, ...] | None = None) -> None:
        # Seconds per scaled unit of each feature; a hand-made model (tests, a warm start) is given here.
        self._theta = list(coefficients) if coefficients is not None else [0.0] * len(FEATURES)
        if len(self._theta) != len(FEATURES):
            raise ValueError(f"a cost model has {len(FEATURES)} coefficients ({', '.join(FEATURES)})")
        self._fixed = coefficients is not None  # hand-made: never refitted
        self._window: deque[tuple[tuple[float, ...], float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.num_observed = 0
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self._error_summary: tuple[float, float] | None = None  # recomputed every REFIT_EVERY errors
        self._errors_since_summary = 0
        # measured / predicted of recent mixed steps, and their OVERRUN_QUANTILE (refreshed like the
        # error summary): the steps an ITL cap is set for.
        self._overruns: deque[float] = deque(maxlen=OVERRUN_WINDOW)
        self._overrun = (1.0, 1.0)  # (median, OVERRUN_QUANTILE)
        self._overruns_since_summary = 0

    @property
    def ready(self) -> bool:
        return self._fixed or self.num_observed >= MIN_STEPS

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per scaled unit of each of `FEATURES` (what a worker reports to the gateway)."""
        return tuple(self._theta)

    def predict(self, shape: StepShape) -> float:
        return max(0.0, sum(c * x for c, x in zip(self._theta, shape.vector(), strict=True)))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A measured step: its prediction error is kept, and it joins the fit's window."""
        if not seconds > 0:
            return
        if self.ready:
            predicted = self.predict(shape)
            self._errors.append(abs(predicted - seconds) / seconds)
            self._errors_since_summary += 1
            if shape.prefill_tokens and shape.decode_rows and predicted > 0:
                self._note_overrun(seconds / predicted)
        if self._fixed:
            return
        self._window.append((shape.vector(), seconds))
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or self.num_observed == MIN_STEPS:
            self._refit()

    def prediction_error(self) -> tuple[float, float] | None:
        """(median, p95) of |predicted - measured| / measured over the recent steps; None before any.
        Cheap to ask every step (the worker's load report does): the sort runs every REFIT_EVERY steps."""
        if self._errors and (self._error_summary is None or self._errors_since_summary >= REFIT_EVERY):
            errors = sorted(self._errors)
            self._error_summary = statistics.median(errors), errors[min(len(errors) - 1, int(0.95 * len(errors)))]
            self._errors_since_summary = 0
        return self._error_summary

    def overrun(self, *, typical: bool = False) -> float:
        """How much longer than predicted a step with decodes and a prefill chunk ran, at the
        OVERRUN_QUANTILE of the recent ones (`typical`: their median): at least 1, at most
        MAX_OVERRUN; 1 until MIN_STEPS such steps were seen. An ITL cap divides its target by the
        quantile (each step must hold it); a TTFT estimate multiplies its steps by the median (a
        prompt waits for many steps)."""
        return self._overrun[0] if typical else self._overrun[1]

    def _note_overrun(self, ratio: float) -> None:
        self._overruns.append(ratio)
        self._overruns_since_summary += 1
        if self._overruns_since_summary >= REFIT_EVERY and len(self._overruns) >= MIN_STEPS:
            ratios = sorted(self._overruns)
            median, high = statistics.median(ratios), ratios[min(len(ratios) - 1, int(OVERRUN_QUANTILE * len(ratios)))]
            self._overrun = (min(MAX_OVERRUN, max(1.0, median)), min(MAX_OVERRUN, max(1.0, high)))
            self._overruns_since_summary = 0

    def _refit(self) -> None:
        """Ridge least squares towards the previous fit: (XᵀX + λI)θ = Xᵀy + λθ_prev; then no
        coefficient below zero (no work makes a step faster)."""
        self._since_fit = 0
        n = len(FEATURES)
        xtx = [[0.0] * n for _ in range(n)]
        xty = [0.0] * n
        for x, y in self._window:
            for i in range(n):
                xi = x[i]
                if xi == 0.0:
                    continue
                xty[i] += xi * y
                row = xtx[i]
                for j in range(n):
                    row[j] += xi * x[j]
        weight = RIDGE * max(1.0, max(xtx[i][i] for i in range(n)))
        for i in range(n):
            xtx[i][i] += weight
            xty[i] += weight * self._theta[i]
        solved = _solve(xtx, xty)
        if solved is not None:
            self._theta = [max(0.0, c) for c in solved]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system; None if singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def prefill_budget(model: StepCostModel, step: StepShape, itl_target_s: float, *, start: int,
                   floor: int, budget: int) -> int:
    """The largest prefill budget in [min(floor, budget), budget] whose predicted step (`step` plus a
    prefill chunk of that many tokens at position `start`) takes at most ITL_HEADROOM of the target.

    The floor guarantees progress: a long prompt still advances under an ITL target no step can
    meet. The prediction grows with the prefill (no coefficient is negative): a binary search.
    """
    low = min(floor, budget)
    limit = itl_target_s * ITL_HEADROOM
    if model.predict(step.with_prefill(budget, start)) <= limit:
        return budget
    if model.predict(step.with_prefill(low, start)) > limit:
        return low
    high = budget  # invariant: low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        if model.predict(step.with_prefill(mid, start)) <= limit:
            low = mid
        else:
            high = mid
    return low


def prefill_rate(model: StepCostModel, step: StepShape, tokens: int, *, start: int, slowdown: float) -> float:
    """Prefill tokens per second in steps of `step` plus `tokens` of prefill (the prediction times
    `slowdown`)."""
    return tokens / max(model.predict(step.with_prefill(tokens, start)) * slowdown, 1e-9)


def late_after_whole_step(model: StepCostModel, step: StepShape, backlog: list[tuple[int, float]], *,
                          start: int, capped: int, whole: int, whole_s: float, slowdown: float) -> bool:
    """Whether one step of the `whole` budget (taking `whole_s`), then capped steps, makes late a
    prompt of `backlog` (as for `ttft_budget`) that capped steps of `capped` tokens alone bring in
    time: every prompt the whole step finishes gets its first token at its end, not one after
    another."""
    rate = prefill_rate(model, step, capped, start=start, slowdown=slowdown)
    for tokens, slack_s in backlog:
        if tokens > rate * slack_s:
            continue  # the capped pace misses this one too: nothing to lose
        if whole_s + max(0, tokens - whole) / rate > slack_s:
            return True
    return False


def ttft_budget(model: StepCostModel, step: StepShape, backlog: list[tuple[int, float]], *, start: int,
                low: int, budget: int, slowdown: float = 1.0) -> int:
    """The smallest prefill budget in [low, budget] at which every prompt in `backlog` that can still
    meet its TTFT target does: (tokens to prefill up to and including that prompt, in the order
    the scheduler serves them; seconds left to its target) pairs. Steps of P prefill tokens take
    T(P) (the model's prediction times `slowdown`: how much longer steps typically run here), so a
    prompt is in time when P * slack / T(P) >= its tokens; P / T(P) grows with P.
    A prompt that would miss even at the whole budget does not raise it (its TTFT is lost; the
    streams' ITL is not spent on it)."""
    def rate(tokens: int) -> float:
        return prefill_rate(model, step, tokens, start=start, slowdown=slowdown)

    need = low
    best = rate(budget)
    for tokens, slack_s in backlog:
        if tokens <= rate(need) * slack_s:
            continue  # in time at what is already granted
        if best * slack_s < tokens:
            continue  # lost even at the whole budget
        lo, hi = need, budget  # lo misses, hi is in time
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if rate(mid) * slack_s >= tokens:
                hi = mid
            else:
                lo = mid
        need = hi
    return need


__all__ = ["FEATURES", "ITL_HEADROOM", "StepCostModel", "StepShape", "late_after_whole_step", "prefill_budget",
           "prefill_rate", "ttft_budget"]
