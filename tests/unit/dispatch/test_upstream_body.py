"""What an upstream is sent for a request: `completion_body` (gateway/dispatch/links/upstream_body.py)."""

from __future__ import annotations

import json

import pytest

from sluice.gateway.dispatch.links.upstream_body import UnsupportedByUpstream, completion_body
from sluice.protocol import GenerateRequest, Priority, SamplingParams, StructuredOutput
from sluice.settings import UpstreamSpec, upstream_root


def request(priority: Priority = Priority.INTERACTIVE, **sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="r1", tenant_id="t1", model="demo", priority=priority,
                           prompt_token_ids=(1, 2, 3), sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
                           cache_salt="salt-t1", arrival_time=0.0)


def test_openai_kind_gets_standard_fields_and_only_the_extensions_set() -> None:
    spec = UpstreamSpec(name="a", base_url="http://x", models=("demo",), served_names={"demo": "org/Demo"})
    body = completion_body(request(max_tokens=7, temperature=0.0, seed=5, stop=("\n",)), spec, priority_enabled=True)
    assert body == {"model": "org/Demo", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.0, "top_p": 1.0,
                    "seed": 5, "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}}
    body = completion_body(request(top_k=20, ignore_eos=True, stop_token_ids=(9,)), spec, priority_enabled=True)
    assert body["top_k"] == 20 and body["ignore_eos"] is True and body["stop_token_ids"] == [9]
    assert "priority" not in body and "cache_salt" not in body and "min_p" not in body


def test_vllm_kind_gets_ids_salt_and_the_class_as_priority() -> None:
    spec = UpstreamSpec(name="v", base_url="http://x/v1/", models=("demo",), kind="vllm", priority=True)
    body = completion_body(request(Priority.BATCH), spec, priority_enabled=True)
    assert body["return_token_ids"] is True and body["cache_salt"] == "salt-t1" and body["priority"] == 2
    assert body["model"] == "demo"
    assert "priority" not in completion_body(request(Priority.BATCH), spec, priority_enabled=False)
    assert upstream_root(spec.base_url) == "http://x"


def test_constraints_and_logit_bias_go_to_a_vllm_upstream_and_fail_elsewhere() -> None:
    vllm = UpstreamSpec(name="v", base_url="http://x", models=("demo",), kind="vllm")
    plain = UpstreamSpec(name="a", base_url="http://x", models=("demo",))
    schema = StructuredOutput(kind="json", spec='{"type":"object"}')
    body = completion_body(request(structured=schema, logit_bias=((5, -100.0),)), vllm, priority_enabled=True)
    assert body["structured_outputs"] == {"json": {"type": "object"}} and body["logit_bias"] == {"5": -100.0}
    choice = completion_body(request(structured=StructuredOutput(kind="choice", spec='["a", "b"]')), vllm,
                             priority_enabled=True)
    assert choice["structured_outputs"] == {"choice": ["a", "b"]}
    tagged = StructuredOutput(kind="tagged", spec=json.dumps(
        {"begin": "<tool_call>\n", "schema": {"type": "object"}, "end": "\n</tool_call>", "repeat": False}))
    tag = json.loads(completion_body(request(structured=tagged), vllm, priority_enabled=True)
                     ["structured_outputs"]["structural_tag"])
    assert tag["triggers"] == ["<tool_call>\n"] and tag["structures"][0]["end"] == "\n</tool_call>"
    assert completion_body(request(logit_bias=((5, 1.0),)), plain, priority_enabled=True)["logit_bias"] == {"5": 1.0}
    with pytest.raises(UnsupportedByUpstream, match="cannot enforce structured outputs"):
        completion_body(request(structured=schema), plain, priority_enabled=True)


def test_logprobs_are_asked_of_a_vllm_upstream_by_token_id_and_of_no_other() -> None:
    vllm = UpstreamSpec(name="v", base_url="http://x", models=("demo",), kind="vllm")
    plain = UpstreamSpec(name="a", base_url="http://x", models=("demo",))
    body = completion_body(request(logprobs=True, top_logprobs=3), vllm, priority_enabled=True)
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
    assert "logprobs" not in completion_body(request(), vllm, priority_enabled=True)
    with pytest.raises(UnsupportedByUpstream, match="cannot return logprobs"):
        completion_body(request(logprobs=True), plain, priority_enabled=True)
