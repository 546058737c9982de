"""What a request's answer says, from its state: usage, logprobs, whole answers, the failure message.

The same builders serve a whole (non-streamed) answer, the chunks of a streamed one
(streams/frames.py) and the result line of a batch request (batches/runner.py), all from the
request's one record (`RequestState`) and the schema structs, so the three never disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.edge.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.state import RequestState
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.generation.tool_parsers import parse_whole, tool_calls_finish
from sluice.protocol import FinishReason, PositionLogprobs, RequestDelta

log = logging.getLogger(__name__)


def usage(state: RequestState) -> Usage:
    prompt = state.num_prompt_tokens
    completion = state.num_output_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        # At most the prompt: a resumed request's engine counts the resumed output it found cached too.
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(state.cached_tokens, prompt)),
    )


def failure_message(state: RequestState) -> str:
    """What the client is told when generation fails; the worker's own reason (exception text,
    worker ids) goes to the log under the request id, never to the client."""
    log.warning("request %s failed: %s", state.request_id, state.error or "backend error")
    return f"Generation failed on the server (request {state.request_id}); please retry."


def refused(state: RequestState) -> OpenAIError | None:
    """An upstream's own 4xx refusal of the request, as the same status and message to the client
    (it is the request that is wrong: a retry would fail again, so no "please retry")."""
    if state.error_status is None:
        return None
    return OpenAIError(state.error_status, state.error or "The upstream server refused the request.",
                       type="invalid_request_error", code="upstream_refused")


async def settled_refusal(flight: Flight) -> OpenAIError:
    """A request whose first delta is an upstream's refusal (`Submission.refusal`), ended and
    settled like any other; the error the client gets for it."""
    flight.listen(lambda _delta: None)  # folds the queued final delta into the state
    try:
        await flight.ended()
    finally:
        flight.finish()
    await flight.settled()
    return refused(flight.state) or OpenAIError(500, failure_message(flight.state), type="server_error",
                                                code="generation_failed")


def failure_body(state: RequestState) -> dict[str, object]:
    rejection = refused(state)
    if rejection is not None:
        return rejection.body()
    return {"error": {"message": failure_message(state), "type": "server_error", "param": None,
                      "code": "generation_failed"}}


def chat_logprobs(
    tokenizer: ModelTokenizer, positions: Sequence[PositionLogprobs], top_n: int
) -> list[TokenLogprobOut]:
    out = []
    for position in positions:
        text = tokenizer.token_text(position.chosen.token_id)
        top = [
            TopLogprob(
                token=(t := tokenizer.token_text(c.token_id)),
                logprob=c.logprob,
                bytes=list(t.encode("utf-8")),
            )
            for c in position.top[:top_n]
        ]
        out.append(
            TokenLogprobOut(
                token=text,
                logprob=position.chosen.logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return out


def completion_logprobs(
    tokenizer: ModelTokenizer, positions: Sequence[PositionLogprobs], top_n: int, offset: int
) -> CompletionLogprobs:
    """`offset`: the characters of the completion before the first of these positions."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for position in positions:
        text = tokenizer.token_text(position.chosen.token_id)
        tokens.append(text)
        values.append(position.chosen.logprob)
        tops.append({tokenizer.token_text(c.token_id): c.logprob for c in position.top[:top_n]})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops if top_n else None, text_offset=offsets
    )


def whole_answer(state: RequestState, text: str, positions: Sequence[PositionLogprobs] = (),
                 tokenizer: ModelTokenizer | None = None) -> ChatCompletion | Completion:
    """The answer of a request that ended (`positions` and `tokenizer` when it asked for logprobs)."""
    envelope, sampling = state.envelope, state.request.sampling
    finish = state.finish_reason
    want_logprobs = sampling.logprobs and tokenizer is not None
    if envelope.endpoint == "chat":
        logprobs = None
        if want_logprobs:
            assert tokenizer is not None  # for the type checker: want_logprobs says so
            logprobs = ChoiceLogprobs(content=chat_logprobs(tokenizer, positions, sampling.top_logprobs))
        message = AssistantMessage(content=text)
        if state.request.tool_format is not None:
            content, calls = parse_whole(text, state.request.tool_format,  # type: ignore[arg-type]
                                         state.request_id)  # the answer's id, or a choice's (n > 1)
            if calls:
                message = AssistantMessage(content=content, tool_calls=calls)
                finish = tool_calls_finish(finish)
        choice = ChatChoice(index=0, message=message, logprobs=logprobs, finish_reason=finish)
        return ChatCompletion(id=envelope.id, created=envelope.created, model=envelope.model,
                              service_tier=envelope.service_tier, choices=[choice], usage=usage(state))
    text_logprobs = None
    if want_logprobs:
        assert tokenizer is not None
        text_logprobs = completion_logprobs(tokenizer, positions, sampling.top_logprobs, 0)
    completion = CompletionChoice(index=0, text=text, logprobs=text_logprobs, finish_reason=finish)
    return Completion(id=envelope.id, created=envelope.created, model=envelope.model,
                      service_tier=envelope.service_tier, choices=[completion], usage=usage(state))


async def complete(flight: Flight, tokenizer: ModelTokenizer) -> ChatCompletion | Completion:
    """A non-streamed answer: every delta's text and logprobs collected, then the whole answer once
    the request ended and its quota settled (the client's next request finds it ended)."""
    texts: list[str] = []
    positions: list[PositionLogprobs] = []

    def collect(delta: RequestDelta) -> None:
        texts.append(delta.text)
        positions.extend(delta.logprobs)

    state = flight.state
    aborted = True
    try:
        flight.listen(collect)
        await flight.ended()
        aborted = False
    finally:
        flight.finish(aborted=aborted and state.finish_reason is None)
    await flight.settled()
    if state.finish_reason == FinishReason.ERROR:
        raise refused(state) or OpenAIError(500, failure_message(state), type="server_error", code="generation_failed")
    return whole_answer(state, "".join(texts), positions, tokenizer)
