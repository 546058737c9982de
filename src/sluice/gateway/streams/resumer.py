"""Continuing a streamed response another replica generated and lost (docs/streams.md, "Replica
takeover"): `StreamResumer` is what `StreamHolder` (gateway/streams/holder.py) calls with a stream it
claimed.

The log says where the stream stands: its first event holds the envelope every chunk repeats
(`id`, `created`, `model`, `service_tier`; a `usage` field when include_usage was asked), each
event the token ids first sent with it. The request is admitted again against the tenant's
quotas (the lost replica's hold was released by the lease sweep, charged as nothing: this
admission and its settlement, to the whole completion, are the request's only charge; its usage
is recorded once, here), dispatched with `resume_token_ids` = the tokens logged, and a pump
continues the log at its next sequence number with the same envelope and no second role chunk.
Followers on any replica see the rest. The pump's disconnect grace applies as on the acceptor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgspec

from sluice.gateway.auth.service import AuthService
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.service import CLASS_TO_TIER, Flight, GenerationService, Prepared
from sluice.gateway.queueing.backend import Submission
from sluice.gateway.quotas.service import Reservation
from sluice.gateway.streams.frames import DONE, stream_chat, stream_completion
from sluice.gateway.streams.holder import MAX_TAKEOVERS, TAKEOVER_FAILED, Claimed, StreamHolder
from sluice.gateway.streams.hub import ABANDONED, StreamHub
from sluice.gateway.streams.log import RedisStreamLog
from sluice.protocol import GenerateRequest

log = logging.getLogger(__name__)

ADMIT_WAIT_S = 30.0  # a taken-over stream the quotas refuse (429, 503) is admitted again until this long
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _event(frame: bytes) -> Any:
    """An event's payload: the chunk as a dict, the string "[DONE]", or None (not JSON)."""
    body = frame.removeprefix(b"data: ").rstrip(b"\n")
    if body == b"[DONE]":
        return "[DONE]"
    try:
        return _decode(body)
    except msgspec.DecodeError:
        return None


def _finish_reason(event: Any) -> str | None:
    if isinstance(event, dict):
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                return str(choice["finish_reason"])
    return None


class ResumingBackend(Protocol):
    holder: StreamHolder | None

    def resume(self, request: GenerateRequest) -> Submission: ...

    def could_serve(self, model: str) -> bool: ...


class StreamResumer:
    def __init__(self, hub: StreamHub, generation: GenerationService, auth: AuthService, backend: ResumingBackend,
                 holder: StreamHolder) -> None:
        if not isinstance(hub.log, RedisStreamLog):
            raise ValueError("a replica takeover needs the stream log in Redis ([shared] url)")
        self.hub = hub
        self.log: RedisStreamLog = hub.log
        self.generation = generation
        self.auth = auth
        self.backend = backend
        self.holder = holder

    def can_continue(self, request: GenerateRequest) -> bool:
        return request.model in self.generation.tokenizers and self.backend.could_serve(request.model)

    async def __call__(self, request: GenerateRequest, claimed: Claimed) -> None:
        rid = request.request_id
        if claimed.ended:
            return  # its end marker came late: the holder releases it at the next check
        if claimed.grace_s == 0:  # `X-Sluice-Disconnect: abort`: its client's connection went with the replica
            log.info("stream %s: its replica was lost and it has no disconnect grace; not continued", rid)
            self.holder.end_with(claimed, ABANDONED)
            return
        if claimed.takeovers > MAX_TAKEOVERS or not claimed.whole:
            why = f"lost {claimed.takeovers} times" if claimed.takeovers > MAX_TAKEOVERS else "its log has a gap"
            log.warning("stream %s: not continued (%s); its log ends with an error", rid, why)
            self.holder.end_with(claimed, TAKEOVER_FAILED)
            return
        if not claimed.frames:  # lost before its first event: no client has seen anything, start it here
            head = {"created": int(time.time()), "service_tier": CLASS_TO_TIER[request.priority]}
            if claimed.include_usage:
                head["usage"] = None
            await self._continue(request, claimed, head)
            return
        last = _event(claimed.frames[-1])
        if last == "[DONE]" or (isinstance(last, dict) and "error" in last):
            self.holder.end_with(claimed, None)  # it had ended: only its end marker was missing
            return
        head = _event(claimed.frames[0])
        if not isinstance(head, dict) or "created" not in head:
            raise ValueError(f"the first event of {rid} is not a chunk")
        finish = next((r for r in map(_finish_reason, map(_event, claimed.frames[-3:])) if r), None)
        if finish is not None or len(claimed.token_ids) >= request.sampling.max_tokens:
            self._finish_tail(request, claimed, head, finish)
            return
        await self._continue(request, claimed, head)

    def _finish_tail(self, request: GenerateRequest, claimed: Claimed, head: dict[str, Any],
                     finish: str | None) -> None:
        """The generation had ended before its replica was lost; its last events were not logged
        (a kill between the finishing chunk and [DONE]): they are written from the log. Usage was
        recorded by the lost replica, or is missing (it was lost before): never recorded twice."""
        frames = []
        chat = request.request_id.startswith("chatcmpl-")
        if finish is None:  # the last token's chunk went out, its finishing chunk did not
            choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if chat
                      else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
            frames.append({**head, "choices": [choice]})
        last = _event(claimed.frames[-1])
        has_usage = isinstance(last, dict) and last.get("usage") is not None
        if "usage" in head and not has_usage:
            prompt, completion = len(request.prompt_token_ids), len(claimed.token_ids)
            frames.append({**head, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}})
        self.log.adopt(claimed.response_id, claimed.tenant, claimed.next_seq, claimed.key)
        for payload in frames:
            self.log.append(claimed.response_id, b"data: " + _encode(payload) + b"\n\n")
        self.log.append(claimed.response_id, DONE)
        self.log.end(claimed.response_id)

    async def _continue(self, request: GenerateRequest, claimed: Claimed, head: dict[str, Any]) -> None:
        tenant = await self.auth.tenant_by_id(request.tenant_id)
        if tenant is None or not tenant.enabled:
            raise ValueError(f"tenant {request.tenant_id} is gone or disabled")
        generation = self.generation
        tokenizer = generation.tokenizers.get(request.model)
        resumed = msgspec.structs.replace(request, resume_token_ids=tuple(claimed.token_ids))
        from_start = not claimed.frames  # its role chunk (chat) is still to be sent
        tier = head.get("service_tier") or CLASS_TO_TIER[request.priority]
        prepared = Prepared(request=resumed, tokenizer=tokenizer, tier=str(tier), stream=True,
                            include_usage="usage" in head)
        reservation = await self._admit(tenant, request)
        try:
            submission = self.backend.resume(resumed)
        except BaseException:
            generation.quotas.release(reservation)
            raise
        loop = asyncio.get_running_loop()
        flight = Flight(generation, prepared, tenant, reservation, submission, created=int(head["created"]),
                        deadline=loop.time() + generation.request_timeout_s)
        self.log.adopt(claimed.response_id, claimed.tenant, claimed.next_seq, claimed.key)
        if request.request_id.startswith("chatcmpl-"):
            frames = stream_chat(flight, resumed=not from_start)
        else:
            offset = 0  # characters sent so far: the text offsets of completion logprobs
            if request.sampling.logprobs:
                for event in map(_event, claimed.frames):
                    for choice in event.get("choices") or () if isinstance(event, dict) else ():
                        offset += len(choice.get("text") or "")
            frames = stream_completion(flight, offset=offset)
        grace_s = claimed.grace_s  # as its POST chose it, else as the tenant's now
        if grace_s is None:
            grace_s = self.hub.grace_s if tenant.disconnect_grace_s is None else tenant.disconnect_grace_s
        self.hub.start(flight, frames, grace_s)

    async def _admit(self, tenant: Any, request: GenerateRequest) -> Reservation:
        """The quota admission of the resumed request, as the acceptor's was (prompt + max_tokens);
        a refusal that waiting may lift (429 with a retry time, 503) is retried, for a while."""
        quotas = self.generation.quotas
        loop = asyncio.get_running_loop()
        give_up = loop.time() + ADMIT_WAIT_S
        while True:
            try:
                return await quotas.admit(tenant, len(request.prompt_token_ids), request.sampling.max_tokens,
                                          request.priority)
            except OpenAIError as exc:
                retry_after = getattr(exc, "retry_after", 1)
                if exc.status not in (429, 503) or retry_after is None or loop.time() > give_up:
                    raise
                await asyncio.sleep(min(max(float(retry_after), 0.2), 2.0))
