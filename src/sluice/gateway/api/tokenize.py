"""vLLM's `POST /tokenize` and `POST /detokenize`, behind the same API keys as the OpenAI routes.

Benchmark clients (`vllm bench serve`) and vLLM-aware applications call these to count and align
prompt tokens with the server's own tokenizer. A tenant reaches only the models it may use; the
request and answer shapes are vLLM's (`TokenizeCompletionRequest` / `TokenizeChatRequest` in one
body, `{count, max_model_len, tokens, token_strs}`; `{model, tokens}` -> `{prompt}`).

vLLM leaves these routes open (its API key guards /v1 only) and `vllm bench serve` calls them
without a key; `[gateway] anonymous_tokenize = true` lets a request without an Authorization
header through too, for every served model. Off by default: the tokenizer is CPU work.
"""

from __future__ import annotations

from typing import Any

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
from sluice.gateway.services import Injected, services

_ERRORS = error_responses(400, 401, 403, 404, 413, notes={404: "Unknown `model`, or none the tenant may use"})


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
        tokenizer, headers = _resolve(generation, _tenant_or_none(request), data.model)
        if data.prompt is not None and data.messages is None:
            add_special = True if data.add_special_tokens is None else data.add_special_tokens
            tokens = tokenizer.encode(data.prompt, add_special_tokens=add_special)
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
            tokens = tokenizer.apply_chat(
                template_messages(data.messages),
                add_generation_prompt=data.add_generation_prompt,
                continue_final_message=data.continue_final_message,
            )
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
        tokenizer, headers = _resolve(generation, _tenant_or_none(request), data.model)
        if any(t < 0 or t >= tokenizer.vocab_size for t in data.tokens):
            raise bad_request(f"tokens must be between 0 and {tokenizer.vocab_size - 1}.", "tokens")
        body = DetokenizeResponse(prompt=tokenizer.decode(data.tokens))
        return Response(body, headers=headers)
