"""What an upstream is sent for a job: the /v1/completions body (docs/upstreams.md, "What is forwarded").

Standard OpenAI fields always; vLLM's sampling extensions only where they differ from their
defaults (a plain OpenAI server need not know them); kind "vllm" also gets exact token ids per
chunk, the tenant's prefix-cache salt, constraints and logprobs by token id. What a kind cannot
serve as asked is `UnsupportedByUpstream`.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.protocol import GenerateRequest, SamplingParams, StructuredOutput
from sluice.settings import UpstreamSpec


class UpstreamError(Exception):
    """A failure of one request at the upstream; the message is fit for the client."""


def completion_body(request: GenerateRequest, spec: UpstreamSpec, *, priority_enabled: bool) -> dict[str, Any]:
    """The /v1/completions body for `request`: standard OpenAI fields, and vLLM's sampling
    extensions only where they differ from their defaults (a plain OpenAI server need not know them)."""
    s: SamplingParams = request.sampling
    body: dict[str, Any] = {
        "model": spec.served_names.get(request.model, request.model),
        "prompt": list(request.prompt_token_ids),
        "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    defaults = SamplingParams()
    for key in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos"):
        if getattr(s, key) != getattr(defaults, key):
            body[key] = getattr(s, key)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in s.logit_bias}
    if s.structured is not None:
        if spec.kind != "vllm":
            raise UnsupportedByUpstream(f"upstream {spec.name!r} (kind {spec.kind}) cannot enforce structured "
                                        "outputs; only a vllm upstream can")
        body["structured_outputs"] = vllm_structured_outputs(s.structured)
    if s.logprobs:
        if spec.kind != "vllm":
            raise UnsupportedByUpstream(f"upstream {spec.name!r} (kind {spec.kind}) cannot return logprobs "
                                        "by token id; only a vllm upstream can")
        # Tokens named by id ("token_id:ID"): the gateway renders them with its own tokenizer.
        body["logprobs"] = s.top_logprobs
        body["return_tokens_as_token_ids"] = True
    if spec.kind == "vllm":
        body["return_token_ids"] = True  # exact ids in each chunk (vLLM >= 0.10.2; ignored before)
        body["cache_salt"] = request.cache_salt  # tenants never share prefix-cache blocks there either
    if spec.priority and priority_enabled:
        body["priority"] = int(request.priority)  # vLLM: lower runs first, as our classes
    return body


class UnsupportedByUpstream(UpstreamError):
    """A request the upstream's kind cannot serve as asked: the job ends with an error naming why."""


def vllm_structured_outputs(structured: StructuredOutput) -> dict[str, Any]:
    """vLLM's `structured_outputs` for a constraint. A `tagged` one (a forced tool call) becomes a
    structural tag triggered by its begin: vLLM enforces the call's format once the model begins
    one, but does not force it to begin (its completions API has no stronger form)."""
    if structured.kind == "json":
        return {"json": json.loads(structured.spec)}
    if structured.kind == "choice":
        return {"choice": json.loads(structured.spec)}
    if structured.kind in ("regex", "grammar"):
        return {structured.kind: structured.spec}
    tagged = json.loads(structured.spec)
    tag = {"type": "structural_tag", "triggers": [tagged["begin"]] if tagged["begin"] else [],
           "structures": [{"begin": tagged["begin"], "schema": tagged["schema"], "end": tagged["end"]}]}
    return {"structural_tag": json.dumps(tag)}
