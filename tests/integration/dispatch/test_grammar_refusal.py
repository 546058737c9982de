"""A sampled token its grammar refuses ends that request alone with an error: the other requests of
the same engine steps (constrained or not) complete, and the worker process serves the next ones.

Runs a real worker process; the refused token itself comes from a test double
(refusing_sampler/sitecustomize.py), as a real sampler never picks a masked token."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from sluice_testing import drain, submit

from sluice.protocol import FinishReason, GenerateRequest, SamplingParams, StructuredOutput

from .conftest import backend_with_worker, wire_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOUBLE = Path(__file__).with_name("refusing_sampler")
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                     "maxItems": 3}},
          "required": ["words"], "additionalProperties": False}


def request(name: str, constrained: bool, max_tokens: int = 60) -> GenerateRequest:
    structured = StructuredOutput(kind="json", spec=json.dumps(SCHEMA)) if constrained else None
    return wire_request(name, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured,
                                             ignore_eos=not constrained))


async def test_a_grammar_refused_token_fails_its_request_alone(
        bootstrap_servers: str, demo_model_dir: Path, start_worker) -> None:
    path = os.pathsep.join(p for p in (str(DOUBLE), os.environ.get("PYTHONPATH", "")) if p)
    async with backend_with_worker(bootstrap_servers, demo_model_dir, start_worker, "gr1", "--max-num-seqs", "4",
                                   extra_env={"PYTHONPATH": path}) as (backend, worker):
        pid = backend.dispatcher.workers["gr1"].pid
        # All three run in the same steps: one refused, one constrained and one plain beside it.
        streams = [await submit(backend, request(name, constrained))
                   for name, constrained in (("refuse", True), ("json", True), ("plain", False))]
        refused, constrained, plain = await asyncio.wait_for(asyncio.gather(*map(drain, streams)), 180)
        assert refused[-1].finish_reason == FinishReason.ERROR and refused[-1].error
        assert "refused" not in refused[-1].error  # no internal detail for the client
        assert sum(len(d.token_ids) for d in refused) == 2  # the tokens before the refused one
        assert constrained[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        json_text = "".join(d.text for d in constrained)
        if constrained[-1].finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(json_text)["words"], list)
        assert plain[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(d.token_ids) for d in plain) == 60

        # The same worker process serves the next requests.
        after = await asyncio.wait_for(drain(await submit(backend, request("json-after", True))), 180)
        assert "".join(d.text for d in after) == json_text  # greedy: the same answer as beside the failure
        assert worker.poll() is None
        assert backend.dispatcher.workers["gr1"].pid == pid
