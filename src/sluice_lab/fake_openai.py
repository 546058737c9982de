"""A FAKE OpenAI-compatible server, for measuring gateway overhead only: it runs no model.

`sluice bench gateway-overhead --upstream fake` puts it behind sluice and behind LiteLLM, and
also measures it directly, so whatever a gateway adds shows up as the difference. It must cost as
little as possible itself, hence plain asyncio streams (uvloop when installed) and hand-written
HTTP/1.1 with keep-alive instead of a web framework; its own saturation rate is measured by the
bench's `direct` column (docs/lab/gateway-overhead.md).

Serves POST /v1/completions and /v1/chat/completions, streamed (SSE, chunked) or not. The timing
is fixed, not computed: the first token comes `--ttft-ms` after the request was read, each further
token `--itl-ms` later (on an absolute schedule, so a busy loop does not stretch the whole stream);
a response has `--tokens` tokens, fewer when `max_tokens` asks for fewer. Prompts may be text or
token ids (vLLM-style `prompt: [ids]`, as sluice forwards them); usage counts token-id prompts
exactly and text by words. `return_token_ids: true` adds vLLM's `token_ids`/`prompt_token_ids`.
GET /health and /v1/models answer too. Anything else: 404. Bodies must be JSON: else 400.

    python src/sluice_lab/fake_openai.py --port 0        # prints "PORT <n>" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from itertools import count
from typing import Any

TOKEN_TEXT = " tok"
TOKEN_ID = 42  # small enough to be in any vocabulary (a gateway may look ids up)
MAX_HEAD_BYTES = 65536
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FakeTiming:
    ttft_s: float = 0.050
    itl_s: float = 0.020
    tokens: int = 32

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.itl_s < 0 or self.tokens < 1:
            raise ValueError("ttft and itl must be >= 0 and tokens >= 1")


_ids = count(1)


def _prompt_tokens(body: dict[str, Any]) -> tuple[int, list[int] | None]:
    """(prompt token count, the ids when the prompt was ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt), list(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return len(prompt[0]), list(prompt[0])
    if isinstance(prompt, str):
        return len(prompt.split()), None
    words = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words += len(content.split())
    return words, None


def _head(status: str, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    connection = "keep-alive" if keep_alive else "close"
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{framing}\r\n"
            f"Connection: {connection}\r\n\r\n").encode()


def _json_response(status: str, payload: Any, keep_alive: bool) -> bytes:
    data = json.dumps(payload).encode()
    return _head(status, "application/json", len(data), keep_alive) + data


def _error(status: str, message: str, keep_alive: bool) -> bytes:
    return _json_response(status, {"error": {"message": message, "type": "invalid_request_error"}},
                          keep_alive)


def _chunk(data: bytes) -> bytes:
    """One HTTP chunk carrying one SSE event."""
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class FakeServer:
    def __init__(self, timing: FakeTiming) -> None:
        self.timing = timing

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD_BYTES:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep_alive = headers.get("connection", "").lower() != "close"
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY_BYTES:
            writer.write(_error("413 Payload Too Large", "body too large", False))
            return False
        raw = await reader.readexactly(length) if length else b""
        if method == "GET" and path in ("/health", "/v1/health"):
            writer.write(_json_response("200 OK", {"status": "ok"}, keep_alive))
        elif method == "GET" and path == "/v1/models":
            writer.write(_json_response("200 OK", {"object": "list", "data": [
                {"id": "fake-model", "object": "model", "owned_by": "fake"}]}, keep_alive))
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                writer.write(_error("400 Bad Request", f"invalid JSON body: {exc}", keep_alive))
            else:
                await self._complete(writer, body, chat=path.endswith("chat/completions"),
                                     keep_alive=keep_alive)
        else:
            writer.write(_error("404 Not Found", f"no route {method} {path}", keep_alive))
        await writer.drain()
        return keep_alive

    async def _complete(self, writer: asyncio.StreamWriter, body: dict[str, Any], *, chat: bool,
                        keep_alive: bool) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        timing = self.timing
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        n = min(timing.tokens, max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else timing.tokens
        prompt_tokens, prompt_ids = _prompt_tokens(body)
        with_ids = bool(body.get("return_token_ids"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        model = json.dumps(str(body.get("model") or "fake-model"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake{next(_ids)}"
        created = int(time.time())
        if not body.get("stream"):
            await asyncio.sleep(timing.ttft_s + (n - 1) * timing.itl_s)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": TOKEN_TEXT * n}
            else:
                choice["text"] = TOKEN_TEXT * n
            if with_ids:
                choice["token_ids"] = [TOKEN_ID] * n
            payload: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                       "created": created, "model": json.loads(model), "choices": [choice],
                                       "usage": usage}
            if with_ids and prompt_ids is not None:
                payload["prompt_token_ids"] = prompt_ids
            writer.write(_json_response("200 OK", payload, keep_alive))
            return
        # Templates built once per request; each token only fills in the finish reason.
        obj = "chat.completion.chunk" if chat else "text_completion"
        prefix = f'{{"id":"{rid}","object":"{obj}","created":{created},"model":{model},"choices":[{{"index":0,'
        ids = f',"token_ids":[{TOKEN_ID}]' if with_ids else ""
        text = json.dumps(TOKEN_TEXT)
        first = (f'"delta":{{"role":"assistant","content":{text}}}' if chat else f'"text":{text}') + ids
        later = (f'"delta":{{"content":{text}}}' if chat else f'"text":{text}') + ids
        writer.write(_head("200 OK", "text/event-stream", None, keep_alive))
        transport = writer.transport
        for i in range(n):
            delay = start + timing.ttft_s + i * timing.itl_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if transport.is_closing():
                return  # the client went away: stop generating, as vLLM aborts
            finish = '"length"' if i == n - 1 else "null"
            extra = ""
            if i == 0 and with_ids and prompt_ids is not None:
                extra = f',"prompt_token_ids":{json.dumps(prompt_ids)}'
            writer.write(_chunk(f'{prefix}{first if i == 0 else later},"logprobs":null,'
                                f'"finish_reason":{finish}}}]{extra}}}'.encode()))
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            tail += _chunk(f'{{"id":"{rid}","object":"{obj}","created":{created},"model":{model},'
                           f'"choices":[],"usage":{json.dumps(usage)}}}'.encode())
        writer.write(tail + _chunk(b"[DONE]") + b"0\r\n\r\n")


async def serve(host: str, port: int, timing: FakeTiming) -> None:
    server = await asyncio.start_server(FakeServer(timing).handle, host, port, backlog=4096,
                                        limit=MAX_HEAD_BYTES + 1)
    bound = server.sockets[0].getsockname()[1]
    print(f"PORT {bound}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed as 'PORT n')")
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        timing = FakeTiming(args.ttft_ms / 1000, args.itl_ms / 1000, args.tokens)
    except ValueError as exc:
        parser.error(str(exc))
    runner: Any = asyncio.run
    if not os.environ.get("FAKE_OPENAI_NO_UVLOOP"):
        try:
            import uvloop  # a faster loop when installed; the server works without it

            runner = uvloop.run
        except ImportError:
            pass
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(args.host, args.port, timing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
