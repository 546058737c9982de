"""From an OpenAI request body to a validated request: its `RequestState` before admission.

Order of checks: model exists (404) → tenant may use it (403) → cheap size limits (message count,
characters: 400 before any tokenization) → body fields (400) → prompt fits the context (400).
Quotas and submission come after (generation/service.py). Pure CPU work with no I/O: the service
runs it on a worker thread when the prompt is large, and the Batch API runs it for every line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from sluice import tracing
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.body_decode import SizeLimits, size_fault
from sluice.gateway.edge.errors import OpenAIError, bad_request, body_fault
from sluice.gateway.edge.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from sluice.gateway.generation.state import Endpoint, Envelope, RequestState
from sluice.gateway.generation.structured import structured_output
from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
from sluice.gateway.generation.tools import call_constraint, fallback_messages, template_tool_calls, tool_request
from sluice.gateway.queueing.backend import LinkLimits
from sluice.grammar import GrammarError
from sluice.grammar import check as grammar_check
from sluice.objectives import Objective, class_objective, resolve
from sluice.protocol import GenerateRequest, Priority, SamplingParams, StructuredOutput
from sluice.settings import ObjectiveSettings

TIER_TO_CLASS = {
    "priority": Priority.INTERACTIVE,
    "default": Priority.STANDARD,
    "auto": Priority.STANDARD,
    "flex": Priority.BATCH,
}
CLASS_TO_TIER = {Priority.INTERACTIVE: "priority", Priority.STANDARD: "default", Priority.BATCH: "flex"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def resolve_priority(tenant: TenantContext, service_tier: str | None) -> Priority:
    """min(requested, ceiling): asking above the ceiling gets the ceiling (no error)."""
    if service_tier is None:
        requested = tenant.default_class
    else:
        requested = TIER_TO_CLASS.get(service_tier)  # type: ignore[assignment]
        if requested is None:
            raise bad_request(
                f"Invalid service_tier {service_tier!r}: expected auto, default, flex or priority.",
                "service_tier",
            )
    # Priority: lower value = more urgent, so the ceiling is the numeric maximum.
    return Priority(max(int(requested), int(tenant.priority_ceiling)))


def _param_of(message: str) -> str | None:
    """The sampling field a `SamplingParams.validate` message is about ("at most 16 stop ..." -> stop)."""
    words = [w.strip(",.:()") for w in message.split()]
    named = [w for w in words if w in _SAMPLING_FIELDS]
    if named:
        return named[0]
    return "stop" if "stop sequence" in message else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: text (content parts joined), and an
    assistant turn's `tool_calls` / a tool turn's `tool_call_id` when they have them."""
    if not messages:
        raise bad_request("messages must contain at least one message.", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}]: only text content parts are supported.", f"messages[{i}].content"
                    )
                parts.append(part.text)
            content = "".join(parts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry tool calls.",
                                  f"messages[{i}].tool_calls")
            entry["tool_calls"] = template_tool_calls(message.tool_calls, i)
        if message.role == "tool":
            if not message.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id is missing: a tool message answers a call.",
                                  f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None and message.role == "tool":
            entry["name"] = message.name
        out.append(entry)
    return out


def _check_grammar(structured: StructuredOutput, param: str) -> None:
    """What the engine's grammar library can enforce (keywords, size, depth): a 400 otherwise."""
    try:
        grammar_check(structured, param=param)
    except GrammarError as exc:
        message = exc.message if param in exc.message else f"{param}: {exc.message}"
        raise bad_request(message, exc.param) from None


def _constraint_param(body: _SamplingFields) -> str:
    """The field that gave the request's output constraint (for a 400 about it)."""
    if isinstance(body, ChatCompletionRequest) and body.response_format is not None \
            and body.response_format.type != "text":
        return "response_format"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            return name
    return "response_format"


def _logit_bias(body: _SamplingFields, tokenizer: ModelTokenizer) -> tuple[tuple[int, float], ...]:
    """OpenAI's {token id: bias} as sorted pairs; every key must be a token id of the model."""
    if not body.logit_bias:
        return ()
    pairs = sorted((int(key), float(value)) for key, value in body.logit_bias.items())
    for token_id, _ in pairs:
        if token_id >= tokenizer.vocab_size:
            raise bad_request(f"logit_bias key {token_id} is not a token id of this model (0 to "
                              f"{tokenizer.vocab_size - 1}).", "logit_bias")
    return tuple(pairs)


def context_exceeded(context: int, prompt_tokens: int, param: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"This model's maximum context length is {context} tokens; your prompt has {prompt_tokens} tokens.",
        param=param,
        code="context_length_exceeded",
    )


class RequestPreparer:
    """Validates bodies into requests for the models this gateway serves."""

    def __init__(self, tokenizers: TokenizerRegistry, could_serve: Callable[[str], bool], limits: SizeLimits,
                 objectives: ObjectiveSettings | None = None,
                 link_limits: Callable[[str], LinkLimits] | None = None) -> None:
        self.tokenizers = tokenizers
        self.could_serve = could_serve
        self.limits = limits
        self.objectives = objectives if objectives is not None else ObjectiveSettings()
        self.link_limits = link_limits or (lambda _model: LinkLimits())

    def model_tokenizer(self, tenant: TenantContext, model: str) -> ModelTokenizer:
        """The tokenizer of a model this tenant may use: 404 for an unknown model, 403 for a forbidden one."""
        tokenizer = self.tokenizers.get(model)
        if not self.could_serve(model):
            raise OpenAIError(
                404,
                f"The model `{model}` is not served by any worker.",
                param="model",
                code="model_not_found",
            )
        if not tenant.allows_model(model):
            raise OpenAIError(
                403,
                f"Your tenant may not use the model `{model}`.",
                type="permission_error",
                param="model",
                code="model_not_allowed",
            )
        return tokenizer

    def prepare(self, tenant: TenantContext, body: ChatCompletionRequest | CompletionRequest,
                header: Objective | None = None) -> RequestState:
        if isinstance(body, ChatCompletionRequest):
            return self.prepare_chat(tenant, body, header)
        return self.prepare_completion(tenant, body, header)

    def _check_size(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        fault = size_fault(body, self.limits)
        if fault is not None:
            raise body_fault(fault)

    def prepare_chat(self, tenant: TenantContext, body: ChatCompletionRequest,
                     header: Objective | None = None) -> RequestState:
        tokenizer = self.model_tokenizer(tenant, body.model)
        self._check_size(body)
        messages = template_messages(body.messages)
        structured = structured_output(body)
        tools = tool_request(body)
        if tools is not None and tools.forced:
            if structured is not None:
                raise bad_request(f"tool_choice {tools.choice!r} forces a tool call, which cannot be combined with "
                                  "another output constraint (response_format, structured_outputs, guided_*).",
                                  "tool_choice")
            structured = call_constraint(tools, tokenizer.tool_format)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        if tokenizer.supports_tools:
            prompt_ids = tokenizer.apply_chat(messages, tools=tools.tools if tools is not None else None)
        elif tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            prompt_ids = tokenizer.apply_chat(fallback_messages(messages, tools))
        else:
            prompt_ids = tokenizer.apply_chat(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._finish(
            tenant, body, tokenizer, prompt_ids, max_tokens,
            endpoint="chat",
            header=header,
            max_tokens_param="max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
            default_max=None,
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
            structured=structured,
            tool_format=tokenizer.tool_format if tools is not None else None,
        )

    def prepare_completion(self, tenant: TenantContext, body: CompletionRequest,
                           header: Objective | None = None) -> RequestState:
        tokenizer = self.model_tokenizer(tenant, body.model)
        if body.echo:
            raise bad_request("echo is not supported.", "echo")
        self._check_size(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        elif len(prompt) >= tokenizer.max_model_len:  # before looking at each of them
            raise context_exceeded(tokenizer.max_model_len, len(prompt), "prompt")
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = [int(t) for t in prompt]
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt_ids):
                raise bad_request(
                    f"prompt token ids must be between 0 and {tokenizer.vocab_size - 1}.", "prompt"
                )
        elif all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("A list of prompts is not supported; send one prompt per request.", "prompt")
        else:
            raise bad_request("prompt must be a non-empty string or a non-empty list of token ids.", "prompt")
        logprobs = body.logprobs
        return self._finish(
            tenant, body, tokenizer, prompt_ids, body.max_tokens,
            endpoint="text",
            header=header,
            default_max=COMPLETIONS_DEFAULT_MAX_TOKENS,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            structured=structured_output(body),
        )

    def _finish(
        self,
        tenant: TenantContext,
        body: _SamplingFields,
        tokenizer: ModelTokenizer,
        prompt_ids: list[int],
        max_tokens: int | None,
        *,
        endpoint: Endpoint,
        header: Objective | None,
        max_tokens_param: str = "max_tokens",
        default_max: int | None,
        logprobs: bool,
        top_logprobs: int,
        structured: StructuredOutput | None,
        tool_format: str | None = None,
    ) -> RequestState:
        if structured is not None:
            _check_grammar(structured, "tools" if structured.kind == "tagged" else _constraint_param(body))
        logit_bias = _logit_bias(body, tokenizer)
        # The body's types bound every number (edge/schemas.py); what is left depends on the model and tenant.
        priority = resolve_priority(tenant, body.service_tier)
        links = self.link_limits(tokenizer.name)
        if logprobs and not links.logprobs:
            raise bad_request(f"logprobs are not available for the model `{tokenizer.name}`: it is served by an "
                              "upstream server of kind openai, whose logprobs sluice cannot relay "
                              "(only a vllm upstream's).", "logprobs")
        context = tokenizer.max_model_len  # the smaller of sluice's and an upstream's (its /v1/models)
        if links.max_model_len is not None:
            context = min(context, links.max_model_len)
        if len(prompt_ids) >= context:
            raise context_exceeded(context, len(prompt_ids), "messages" if endpoint == "chat" else "prompt")
        room = context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(room, default_max) if default_max is not None else room
            if tenant.limits.max_output_tokens is not None:
                max_tokens = min(max_tokens, tenant.limits.max_output_tokens)
        elif max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {context} tokens; you requested "
                f"{len(prompt_ids)} prompt tokens + {max_tokens} {max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        stop = body.stop
        stop_tuple = (stop,) if isinstance(stop, str) else tuple(stop or ())
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if top_p == 0.0:  # keep only the most likely token: greedy, exactly as temperature 0
            temperature, top_p = 0.0, 1.0
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=max(body.top_k or 0, 0),  # vLLM clients send -1 for "off", as 0 is here
                min_p=body.min_p or 0.0,
                seed=body.seed,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                stop=stop_tuple,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                structured=structured,
                logit_bias=logit_bias,
            )
            sampling.validate()
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message[:1].upper() + message[1:] + ".", _param_of(message)) from None
        stream = bool(body.stream)
        if body.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        objective = resolve(class_objective(self.objectives, priority), priority, tenant.objective, header)
        choices = body.n or 1
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        arrival = time.time()
        request = GenerateRequest(
            request_id=request_id,
            tenant_id=tenant.id,
            model=tokenizer.name,
            priority=priority,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            cache_salt=tenant.id,
            arrival_time=arrival,
            tenant_weight=tenant.weight,
            ttft_target_s=objective.ttft_s,
            itl_target_s=objective.itl_s,
            traceparent=tracing.current_traceparent(),
            tool_format=tool_format,
        )
        envelope = Envelope(
            # A client that did not ask for a tier is told "default", whatever class its tenant's
            # default put it in (clients file usage under the tier they are told: issue #35); one
            # that asked is told the tier it ran at (its ask, or less under the tenant's ceiling).
            # The class itself is the `x-sluice-class` header.
            id=request_id, created=int(arrival), model=tokenizer.name,
            service_tier="default" if body.service_tier is None else CLASS_TO_TIER[priority],
            endpoint=endpoint, include_usage=bool(stream and body.stream_options and body.stream_options.include_usage),
            choices=choices,
        )
        return RequestState(request=request, envelope=envelope, tenant_name=tenant.name, stream=stream)
