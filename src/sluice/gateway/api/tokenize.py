"""vLLM's `POST /tokenize` and `POST /detokenize`, behind the same API keys as the OpenAI routes.

Benchmark clients (`vllm bench serve`) and vLLM-aware applications call these to count and align
prompt tokens with the server's own tokenizer. A tenant reaches only the models it may use; the
request and answer shapes are vLLM's (`TokenizeCompletionRequest` / `TokenizeChatRequest` in one
body, `{count, max_model_len, tokens, token_strs}`; `{model, tokens}` -> `{prompt}`).

vLLM leaves these routes open (its API key guards /v1 only) and `vllm bench serve` calls them
without a key; `[gateway] anonymous_tokenize = true` lets a request without an Authorization
header through too, for every served model. Off by default: the tokenizer is CPU work.

They are held to what /v1 is held to: the same cheap size limits (`gateway.max_prompt_chars`,
`gateway.max_messages`; a token list no longer than the model's context), a large prompt tokenized
off the event loop in the tenant-fair pool, and each call counted against the tenant's requests/min
and concurrency (no tokens are charged: nothing is generated).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from litestar import Controller, Request, Response, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import JSONBody

from sluice.gateway.auth.guards import tenant_guard
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.errors import OpenAIError, bad_request, error_responses
from sluice.gateway.edge.openapi import TENANT_SECURITY
from sluice.gateway.edge.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from sluice.gateway.generation.prepare import template_messages
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.generation.tokenize_pool import INLINE_PROMPT_CHARS
from sluice.gateway.services import Injected, services
from sluice.protocol import Priority

T = TypeVar("T")

_ERRORS = error_responses(400, 401, 403, 404, 413, 429, notes={404: "Unknown `model`, or none the tenant may use"})


async def tokenize_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A tenant key, as on /v1; no Authorization header at all only where anonymous_tokenize is on."""
    if connection.headers.get("authorization") is None and services(connection).settings.gateway.anonymous_tokenize:
        connection.state.tenant = None
        return
    await tenant_guard(connection, handler)


def _tenant_or_none(request: ASGIConnection[Any, Any, Any, Any]) -> TenantContext | None:
    return request.state.tenant  # type: ignore[no-any-return]


def _tokenizer(generation: GenerationService, tenant: TenantContext | None, model: str | None) -> ModelTokenizer:
    if model is not None:
        if tenant is None:
            return generation.tokenizers.get(model)
        return generation.preparer.model_tokenizer(tenant, model)
    allowed = [name for name in generation.tokenizers.names() if tenant is None or tenant.allows_model(name)]
    if not allowed:
        raise OpenAIError(404, "No model is available to your tenant.", param="model", code="model_not_found")
    return generation.tokenizers.get(allowed[0])


def _resolve(generation: GenerationService, tenant: TenantContext | None,
             model: str | None) -> tuple[ModelTokenizer, dict[str, str]]:
    """The tokenizer a request names (or its tenant's first model) and the answer's quota headers."""
    tokenizer = _tokenizer(generation, tenant, model)
    return tokenizer, {} if tenant is None else generation.quotas.headers(tenant)


def _check_size(generation: GenerationService, data: TokenizeRequest) -> int:
    """The /v1 cheap limits (400 before any tokenization); returns the characters to tokenize."""
    limits = generation.limits
    if data.messages is not None and len(data.messages) > limits.max_messages:
        raise OpenAIError(400, f"messages has {len(data.messages)} items; at most {limits.max_messages} are allowed.",
                          param="messages", code="array_above_max_length")
    chars = len(data.prompt or "") + sum(
        len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or ())
        for m in data.messages or ()
    )
    if chars > limits.max_prompt_chars:
        raise OpenAIError(400, f"The prompt has {chars} characters; at most {limits.max_prompt_chars} are allowed.",
                          param="prompt" if data.prompt is not None else "messages", code="string_above_max_length")
    return chars


async def _metered(generation: GenerationService, tenant: TenantContext | None, large: bool,
                   work: Callable[..., T], *args: object) -> T:
    """`work(*args)` counted against the tenant's requests/min and concurrency (no tokens: nothing
    is generated), on the tenant-fair tokenizer pool when `large` (anonymous callers share one lane)."""
    reservation = None if tenant is None else await generation.quotas.admit(tenant, 0, 0, Priority.STANDARD)
    try:
        if not large:
            return work(*args)
        return await generation.tokenize_pool.run("" if tenant is None else tenant.id, work, *args)
    finally:
        if reservation is not None:
            generation.quotas.settle(reservation, 0, 0)


class TokenizeController(Controller):
    path = "/"
    tags = ["vLLM tokenization"]  # noqa: RUF012
    guards = [tokenize_guard]  # noqa: RUF012
    security = TENANT_SECURITY

    @post("/tokenize", status_code=200, summary="Tokenize a prompt or chat messages (vLLM)", responses=_ERRORS)
    async def tokenize(
        self,
        request: Request[Any, Any, Any],
        generation: Injected[GenerationService],
        data: JSONBody[TokenizeRequest],
    ) -> Response[TokenizeResponse]:
        tenant = _tenant_or_none(request)
        tokenizer, headers = _resolve(generation, tenant, data.model)
        large = _check_size(generation, data) > INLINE_PROMPT_CHARS
        if data.prompt is not None and data.messages is None:
            add_special = True if data.add_special_tokens is None else data.add_special_tokens
            tokens = await _metered(generation, tenant, large, functools.partial(
                tokenizer.encode, data.prompt, add_special_tokens=add_special))
        elif data.messages is not None and data.prompt is None:
            if data.add_generation_prompt and data.continue_final_message:
                raise bad_request(
                    "continue_final_message and add_generation_prompt cannot both be true.",
                    "continue_final_message",
                )
            if data.add_special_tokens:
                raise bad_request(
                    "add_special_tokens is not supported with messages: the chat template places them.",
                    "add_special_tokens",
                )
            tokens = await _metered(generation, tenant, large, functools.partial(
                tokenizer.apply_chat,
                template_messages(data.messages),
                add_generation_prompt=data.add_generation_prompt,
                continue_final_message=data.continue_final_message,
            ))
        else:
            raise bad_request("Give exactly one of prompt (a string) and messages (a chat).", "prompt")
        body = TokenizeResponse(
            count=len(tokens),
            max_model_len=tokenizer.max_model_len,
            tokens=tokens,
            token_strs=tokenizer.token_strings(tokens) if data.return_token_strs else None,
        )
        return Response(body, headers=headers)

    @post("/detokenize", status_code=200, summary="Text of a token sequence (vLLM)", responses=_ERRORS)
    async def detokenize(
        self,
        request: Request[Any, Any, Any],
        generation: Injected[GenerationService],
        data: JSONBody[DetokenizeRequest],
    ) -> Response[DetokenizeResponse]:
        tenant = _tenant_or_none(request)
        tokenizer, headers = _resolve(generation, tenant, data.model)
        if len(data.tokens) > tokenizer.max_model_len:  # no model reads or writes a longer sequence
            raise OpenAIError(400, f"tokens has {len(data.tokens)} items; at most {tokenizer.max_model_len} (the "
                              "model's context) are allowed.", param="tokens", code="array_above_max_length")
        if any(t < 0 or t >= tokenizer.vocab_size for t in data.tokens):
            raise bad_request(f"tokens must be between 0 and {tokenizer.vocab_size - 1}.", "tokens")
        text = await _metered(generation, tenant, len(data.tokens) > INLINE_PROMPT_CHARS // 4, tokenizer.decode,
                              data.tokens)
        body = DetokenizeResponse(prompt=text)
        return Response(body, headers=headers)
