"""A request's output has one writer (`RequestState.take_output`, generation/state.py), and a
resumed request goes on after the tokens delivered before: worker failover and replica takeover
both resume from the state's token ids."""

from __future__ import annotations

import pytest

from sluice.gateway.generation.state import Envelope, RequestState
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

pytestmark = pytest.mark.unit


def state(output: tuple[int, ...] = ()) -> RequestState:
    request = GenerateRequest(request_id="r", tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1, 2, 3), sampling=SamplingParams(), cache_salt="s", arrival_time=0.0)
    envelope = Envelope(id="r", created=0, model="m", service_tier="default", endpoint="chat")
    made = RequestState(request=request, envelope=envelope, tenant_name="t", output_token_ids=list(output),
                        num_logged_tokens=len(output))
    made.resume_after(output)
    return made


def test_a_taken_over_request_counts_the_tokens_delivered_before_and_goes_on_after_them() -> None:
    taken = state(output=(7, 8))
    assert taken.request.resume_token_ids == (7, 8)
    assert taken.num_output_tokens == 2 and taken.resumable and not taken.has_output
    added = taken.take_output(RequestDelta(request_id="r", token_ids=(9,), text="x", num_output_tokens=3,
                                           num_cached_tokens=5))
    assert added == 1 and taken.output_token_ids == [7, 8, 9] and taken.has_output
    assert taken.unlogged_tokens() == [9]
    taken.logged()
    assert taken.unlogged_tokens() == []
    assert taken.cached_tokens == 5 and taken.text_chars == 1


def test_the_first_output_stands_for_the_request_and_the_final_delta_ends_it() -> None:
    running = state()
    running.take_output(RequestDelta(request_id="r", token_ids=(5,), num_output_tokens=1, num_cached_tokens=2,
                                     first_token_time=10.0, first_scheduled_time=9.0))
    running.resume_after(running.output_token_ids)  # a worker failover: the next attempt's cache hit is not one
    running.take_output(RequestDelta(request_id="r", token_ids=(6,), num_output_tokens=2, num_cached_tokens=4,
                                     first_token_time=20.0, first_scheduled_time=19.0))
    assert (running.cached_tokens, running.engine_first_token, running.engine_first_scheduled) == (2, 10.0, 9.0)
    running.take_output(RequestDelta(request_id="r", finish_reason=FinishReason.LENGTH, num_output_tokens=2,
                                     num_prompt_tokens=3))
    assert running.finish_reason == "length" and running.num_output_tokens == 2 and running.num_prompt_tokens == 3


def test_an_upstream_that_sends_no_ids_is_counted_and_cannot_resume() -> None:
    upstream = state()
    upstream.take_output(RequestDelta(request_id="r", text="hello", num_output_tokens=2))
    assert upstream.num_output_tokens == 2 and not upstream.resumable and upstream.has_output
    upstream.reset_output()
    assert upstream.num_output_tokens == 0 and upstream.resumable and not upstream.has_output
