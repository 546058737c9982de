"""Test double, loaded by a worker process started with this folder first on PYTHONPATH (Python
imports `sitecustomize` at start-up): the runner's sampled token of a request whose id starts with
"refuse-" is replaced, after two output tokens, by a token its grammar refuses.

A fault that cannot be provoked otherwise: the masks allow only tokens the grammar accepts, so a
real sampler never picks a refused one unless llguidance's matcher breaks on its own. Everything
else (engine, scheduler, grammar, worker link) is the real code.
"""

from __future__ import annotations

from sluice.workers.runner import ModelRunner
from sluice.workers.scheduler_output import RunnerOutput, SchedulerOutput

_real_execute = ModelRunner.execute


def _refused_token(chunk) -> int:
    grammar = chunk.request.grammar
    return next(t for t in range(100_000) if grammar.num_accepted([t]) == 0)


def _execute(self: ModelRunner, scheduled: SchedulerOutput) -> RunnerOutput:
    out = _real_execute(self, scheduled)
    for chunk in scheduled.chunks:
        request = chunk.request
        rid = request.request_id
        if (rid.startswith("refuse-") and rid in out.sampled_token_ids and request.grammar is not None
                and request.num_output_tokens >= 2):
            out.sampled_token_ids[rid] = (_refused_token(chunk), *out.sampled_token_ids[rid][1:])
    return out


ModelRunner.execute = _execute  # type: ignore[method-assign]
