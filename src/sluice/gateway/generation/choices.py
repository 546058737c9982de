"""An answer of n choices (`n` > 1): n engine requests, one `RequestState` each, merged into one answer.

Each choice is a request of its own, with its own state (output, worker, failover, quota hold,
record), held in the flights' table under its own id: the answer's id for choice 0, `<id>-<i>` for
choice i. Nothing that follows a request (dispatch, failover, fair share, records) needs to know
about choices; only the answer's envelope says how many there are (`Envelope.choices`), and this
module launches them and merges their answers.

- Seeds: choice i samples with `seed + i` (wrapped into int64), so a seeded request repeats
  choice by choice; without a seed each choice samples on its own.
- The prompt's KV: the engine's tenant-salted prefix cache shares the blocks between the choices
  (they have the same prompt and salt).
- Usage: the prompt counted once, the completion tokens of every choice summed (as OpenAI's).
- Quotas: each choice is admitted as one request (requests, concurrency and tokens count n times:
  n × (prompt + max_tokens) reserved); when one is refused, those already launched are aborted.
- Streaming with n > 1 is refused for now (generation/prepare.py): one stream log per answer
  holds one request's events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.schemas import ChatCompletion, Completion, PromptTokensDetails, Usage
from sluice.gateway.generation.answers import complete
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.state import RequestState
from sluice.gateway.generation.tokenization import ModelTokenizer

_INT64 = 2**64


def _seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    return (seed + index + 2**63) % _INT64 - 2**63


def fork(state: RequestState) -> list[RequestState]:
    """The states of an answer's choices (`state` is choice 0); one state when n is 1."""
    states = [state]
    request = state.request
    for index in range(1, state.envelope.choices):
        sampling = msgspec.structs.replace(request.sampling, seed=_seed(request.sampling.seed, index))
        choice = msgspec.structs.replace(request, request_id=f"{request.request_id}-{index}", sampling=sampling)
        states.append(RequestState(request=choice, envelope=state.envelope, tenant_name=state.tenant_name,
                                   stream=state.stream))
    return states


Launch = Callable[[TenantContext, RequestState], Awaitable[Flight]]


async def launch_all(launch: Launch, tenant: TenantContext, states: list[RequestState]) -> list[Flight]:
    """Every choice admitted and submitted, in order; when one is refused the others are aborted."""
    flights: list[Flight] = []
    try:
        for state in states:
            flights.append(await launch(tenant, state))
    except BaseException:
        for flight in flights:
            flight.finish(aborted=True)
        raise
    return flights


async def complete_all(flights: list[Flight], tokenizer: ModelTokenizer) -> ChatCompletion | Completion:
    """The whole answer of every choice, merged: choices by index, usage summed (prompt once)."""
    # A task group: when one choice fails (or the client goes away) the others are cancelled,
    # which aborts them at their workers (complete() finishes its flight either way).
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(complete(flight, tokenizer)) for flight in flights]
    answers = [task.result() for task in tasks]
    first = answers[0]
    choices = [msgspec.structs.replace(answer.choices[0], index=i) for i, answer in enumerate(answers)]
    prompt = first.usage.prompt_tokens if first.usage is not None else 0
    completion = sum(a.usage.completion_tokens for a in answers if a.usage is not None)
    cached = first.usage.prompt_tokens_details.cached_tokens if first.usage is not None else 0
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
    return msgspec.structs.replace(first, choices=choices, usage=usage)  # type: ignore[arg-type]
