"""HTTP bodies of the OpenAI-compatible API (msgspec). Converted to `sluice.protocol` at the edge.

Unknown fields that OpenAI or vLLM clients send are ignored (msgspec's default), not rejected.
Every numeric field carries the range that the engine and the msgpack wire format accept, so
msgspec rejects anything else with a 400 naming the field, in HTTP bodies and batch lines alike,
and the OpenAPI document shows the same ranges (it is generated from these types).

Edge cases, as OpenAI and vLLM define them: `temperature: 0` and `top_p: 0` are greedy; `top_k`
0 or -1 keeps every token and values at or above the vocabulary size do the same; `min_p: 0` is off.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

# ---- ranges ------------------------------------------------------------------------------------

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20

MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX, description="At most the context left after the prompt")]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 = greedy")]
TopP = Annotated[float, Meta(ge=0.0, le=1.0, description="0 = greedy, 1 = off")]
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX, description="0 or -1 = off, 1 = greedy")]
MinP = Annotated[float, Meta(ge=0.0, le=1.0, description="0 = off")]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0, description="1 = off")]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
MAX_TOOLS = 128  # OpenAI's limit on tools per request
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
ServiceTier = Literal["auto", "default", "flex", "priority"]
OnlyOne = Annotated[int, Meta(ge=1, le=1, description="Only 1 is supported: send separate requests")]
MAX_CHOICES = 128  # OpenAI's bound on n; the gateway's own cap is `gateway.max_n`
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES, description="At most the gateway's max_n (default 8)")]
# OpenAI's shape: token id (as a string) -> bias in [-100, 100], at most 300 entries.
LogitBias = Annotated[
    dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100.0, le=100.0)]],
    Meta(max_length=300),
]

# ---- requests ----------------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it (OpenAI's shape)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a `tool` turn: the call it answers


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stop_token_ids: StopTokenIds | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    service_tier: ServiceTier | None = None  # priority -> interactive, auto/default -> standard, flex -> batch
    user: str | None = None  # accepted and not used (OpenAI uses it for abuse monitoring)
    ignore_eos: bool | None = None
    n: Choices | None = None  # choices of one answer, each its own engine request (generation/choices.py)
    logit_bias: LogitBias | None = None  # keys must be token ids of the model (checked in prepare)
    # vLLM's request extensions for constrained output (generation/structured.py): its current
    # `structured_outputs` object and the older `guided_*` fields, with vLLM's names.
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object.

    `structural_tag` is refused (400); vLLM's whitespace and fallback knobs
    (`disable_any_whitespace`, `whitespace_pattern`, `disable_fallback`, ...) are ignored."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None  # OpenAI requires it; sluice does not use it
    description: str | None = None
    schema: dict[str, Any] | bool | None = None  # None: any JSON object
    strict: bool | None = None  # the grammar always enforces the schema; `strict` changes nothing


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema" (anything else is a 400)
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str | None = None  # required: a missing name is a 400 naming tools[i].function.name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: a function without arguments
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: str = "function"  # only "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # wins over max_tokens when both are given (as vLLM)
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    # Tool calling (generation/tools.py). The legacy `functions` / `function_call` are refused.
    tools: Annotated[list[ToolDefinition], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | NamedToolChoice | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool | None = None  # default true (OpenAI's)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # a string, a list of token ids; a list of strings is rejected ("not supported")
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(min_length=1)]
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: OnlyOne | None = None
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
    tokens: list[TokenId]


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
    tool_calls: list[ToolCall] | UnsetType = UNSET  # absent unless the model called tools


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


class ToolCallFunctionDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # in a call's first delta only
    arguments: str = ""  # the next piece of the arguments' JSON text


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A piece of a streamed tool call, as OpenAI sends it: `index` (which call), and `id`, `type`
    and the name only in the call's first delta."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: ToolCallFunctionDelta


class ChunkDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


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
    tokens: list[TokenId]
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
