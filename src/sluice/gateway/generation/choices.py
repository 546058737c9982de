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
- Usage: the prompt counted once, the completion tokens of every choice summed (as OpenAI's);
  the tenant's usage records and token quotas likewise (`RequestState.bills_request`: choice 0
  bills the prompt and the request, the others their completion tokens alone).
- Quotas: each choice is admitted on its own (concurrency and requests/min count n times; tokens
  prompt + n × max_tokens reserved); when one is refused, those already launched are aborted.
- Streaming: the choices' chunks interleave in one SSE response, each with its index
  (streams/choices.py); such a stream is not resumable (no stream log holds several requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.schemas import ChatCompletion, Completion, Usage
from sluice.gateway.generation.answers import complete, usage
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
                                   stream=state.stream, bills_request=False))
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
    choices = [msgspec.structs.replace(answer.choices[0], index=i) for i, answer in enumerate(answers)]
    merged = answer_usage([flight.state for flight in flights])
    return msgspec.structs.replace(answers[0], choices=choices, usage=merged)  # type: ignore[arg-type]


def answer_usage(states: list[RequestState]) -> Usage:
    """The usage of an answer of these choices: the prompt once (choice 0's), completions summed."""
    first = usage(states[0])
    completion = sum(state.num_output_tokens for state in states)
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                 total_tokens=first.prompt_tokens + completion,
                 prompt_tokens_details=first.prompt_tokens_details)
