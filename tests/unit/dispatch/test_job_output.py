"""A job's output has one writer (gateway/dispatch/jobs.py): a taken-over stream's delivered tokens count
as its output, so a later worker failover resumes after them."""

from __future__ import annotations

import pytest

from sluice.gateway.dispatch.jobs import Job
from sluice.protocol import GenerateRequest, Priority, RequestDelta, SamplingParams


def job(resume: tuple[int, ...] = ()) -> Job:
    request = GenerateRequest(request_id="r", tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1, 2, 3), sampling=SamplingParams(), cache_salt="s", arrival_time=0.0,
                              resume_token_ids=resume)
    return Job(request=request, sink=lambda delta: None)


def test_a_taken_over_job_counts_the_tokens_delivered_before_and_goes_on_after_them() -> None:
    taken = job(resume=(7, 8))
    taken.resume_after(taken.request.resume_token_ids)
    assert taken.num_output_tokens == 2 and taken.resumable
    _, added = taken.take_output(RequestDelta(request_id="r", token_ids=(9,), num_output_tokens=1))
    assert added == 1 and taken.output_token_ids == [7, 8, 9]


def test_only_a_fresh_job_resumes_after_another_replicas_tokens() -> None:
    running = job()
    running.take_output(RequestDelta(request_id="r", token_ids=(5,), num_output_tokens=1))
    with pytest.raises(ValueError, match="already has output"):
        running.resume_after((7, 8))
