"""The adaptive chunk policy's decision for one step: how much of the token budget prefill may take
once the decodes are in (issue #32; the rule is in workers/step_budget.py, the model there too).

The scheduler asks `AdaptiveChunkBudget.prefill_budget` between its decode pass and its prefill
pass. Three inputs set the answer: the tightest ITL target among the step's decoding streams (the
cap), the TTFT targets of prompts still to prefill, and each stream's allowance of slow gaps under a
percentile objective. Where every step must hold the target (`itl_slow_share` 0), a TTFT target may
raise the cap as far as it needs. Under a percentile objective the cap is lifted only to the whole
budget, for one step, while every stream it would make late has a slow gap left, and not when that
step would make late a prompt that capped steps bring in time: a step gives every prompt it
finishes its first token at its end, so a burst of prompts prefilled in one long step all miss a
TTFT that capped steps, finishing them one after another, meet for the first few.

Prediction error is paid for twice over. The cap is the target divided by how far measured steps
of this kind (decodes with a prefill chunk) overran their prediction at the 95th percentile
(`StepCostModel.overrun`), so a host whose step times jitter gets a lower cap. And the allowance is
counted in the gaps each stream actually saw over its target (`Request.num_slow_gaps`), not in the
whole-budget steps granted: a capped step that overran anyway, or a slow host, spends it too, and a
whole-budget step that came in on time costs nothing.
Pure Python (the scheduler is torch-free).
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.workers.config import SchedulerConfig
from sluice.workers.request import Request
from sluice.workers.scheduler_output import StepBuilder
from sluice.workers.step_budget import (
    ITL_HEADROOM,
    StepCostModel,
    StepShape,
    late_after_whole_step,
    prefill_budget,
    ttft_budget,
)

TTFT_LOOKAHEAD = 16  # waiting requests whose TTFT the adaptive budget looks after


class AdaptiveChunkBudget:
    """Sizes each step's prefill to the objectives of the requests in it; owns the step-cost model."""

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel) -> None:
        self.config = config
        self.cost_model = cost_model

    def prefill_budget(self, step: StepBuilder, running: list[Request],
                       waiting_head: Callable[[int], list[Request]], now: float) -> int:
        """What is left of the budget for prefill once the decodes are in `step` (module docstring).
        `running` is sorted by rank; `waiting_head(n)` gives the first n waiting requests in rank order."""
        target = min((entry[0].itl_target_s for entry in step.decodes.values()
                      if entry[0].itl_target_s is not None), default=None)
        if target is None or not self.cost_model.ready:
            return step.budget  # nobody waits on this step's time, or nothing known yet: full budget
        decodes = StepShape(
            decode_rows=len(step.decodes),
            context_tokens=sum(start + n for _, start, n, _ in step.decodes.values()),
            verify_rows=sum(len(drafts) for *_, drafts in step.decodes.values()),
        )
        # The prefill's position: that of the most urgent running request still prefilling (its
        # attention reads what it computed so far), else a new admission's (from 0).
        start = next((r.num_computed_tokens for r in running
                      if not step.has(r) and r.num_tokens - r.num_computed_tokens > 1), 0)
        overrun = self.cost_model.overrun()
        budget = prefill_budget(self.cost_model, decodes, target / overrun, start=start,
                                floor=self.config.min_prefill_chunk, budget=step.budget)
        if budget == step.budget:
            return budget
        slowdown = self.cost_model.overrun(typical=True)
        if self.config.itl_slow_share > 0:
            # Under a percentile objective TTFT is served by whole-budget steps within the slow gaps
            # the streams have left, never by a raise of every step past the ITL cap; and not when
            # the whole step would make late a prompt that the capped steps bring in time.
            whole_s = self.cost_model.predict(decodes.with_prefill(step.budget, start)) * overrun
            if self._slow_gap_left(step, whole_s) and not late_after_whole_step(
                    self.cost_model, decodes, _ttft_backlog(step, running, waiting_head(TTFT_LOOKAHEAD), now),
                    start=start, capped=budget, whole=step.budget, whole_s=whole_s, slowdown=slowdown):
                return step.budget
            return budget
        backlog = _ttft_backlog(step, running, waiting_head(TTFT_LOOKAHEAD), now)
        return ttft_budget(self.cost_model, decodes, backlog, start=start, low=budget, budget=step.budget,
                           slowdown=slowdown)

    def _slow_gap_left(self, step: StepBuilder, whole_s: float) -> bool:
        """An ITL objective at a percentile forgives a share of slow gaps: while every decoding stream
        that a whole-budget step of `whole_s` would make late has one left (itl_slow_share of its
        max_tokens - 1 gaps, less those it already saw), this step may be one: few long steps finish
        a prompt sooner than many capped ones, and each costs a stream one gap however much prefill
        it carries. A stream with a looser target, which the step keeps in time, needs none."""
        share = self.config.itl_slow_share
        return all(r.num_slow_gaps < int(share * (r.sampling.max_tokens - 1))
                   for r, *_ in step.decodes.values()
                   if r.itl_target_s is not None and whole_s > r.itl_target_s * ITL_HEADROOM)


def _ttft_backlog(step: StepBuilder, running: list[Request], waiting: list[Request],
                  now: float) -> list[tuple[int, float]]:
    """(prefill tokens up to and including it, seconds left to its TTFT target) of each prompt with a
    target still to prefill, in the order prefill is served: running ones, then the waiting ones
    given (prefix-cache hits ignored: an over-estimate)."""
    backlog: list[tuple[int, float]] = []
    tokens = 0
    for request in [*(r for r in running if not step.has(r)), *waiting]:
        left = request.num_tokens - request.num_computed_tokens
        if left <= 1:
            continue
        tokens += left
        if request.ttft_target_s is not None and request.first_token_time is None:
            slack = request.arrival_time + request.ttft_target_s - now
            if slack > 0:
                backlog.append((tokens, slack))
    return backlog


__all__ = ["TTFT_LOOKAHEAD", "AdaptiveChunkBudget"]
