"""HTTP bodies of the OpenAI-compatible API (msgspec). Converted to `sluice.protocol` at the edge.

Unknown fields that OpenAI or vLLM clients send are ignored (msgspec's default), not rejected.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---- requests ----------------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    service_tier: str | None = None  # priority | default | auto | flex
    user: str | None = None  # accepted and not used (OpenAI uses it for abuse monitoring)
    ignore_eos: bool | None = None
    n: int | None = None  # only 1
    logit_bias: dict[str, float] | None = None  # only empty: the engine applies no bias


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # only "text"; json_object / json_schema are refused
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given (as vLLM)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # Tool calling is not supported: tools / functions are refused, tool_choice only "none";
    # parallel_tool_calls is accepted (without tools there are no calls to run in parallel).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # a string, a list of token ids; a list of strings is rejected ("not supported")
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize body: either `prompt` (completions form) or `messages` (chat form)."""

    model: str | None = None  # None: the first served model the tenant may use (vLLM: its one model)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # `prompt` only (default true); with `messages` only false
    add_generation_prompt: bool = True  # chat form only
    continue_final_message: bool = False  # chat form only
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens served from the (tenant-salted) prefix cache


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprobOut] | None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    service_tier: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    service_tier: str
    choices: list[ChatChunkChoice]
    # null on every chunk when include_usage is set (the final one carries it); UNSET = absent
    usage: Usage | UnsetType | None = UNSET


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    service_tier: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    service_tier: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType | None = UNSET


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
