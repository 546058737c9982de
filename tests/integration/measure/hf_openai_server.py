"""A second, independent OpenAI-compatible server for testing `sluice bench serve`.

Standard library HTTP server + HF transformers greedy decoding, token by token, streamed as
OpenAI SSE chunks. It shares no code with sluice's gateway or engine: if the load generator
works against this, it is not tied to sluice.

    python hf_openai_server.py MODEL_DIR   -> prints "PORT <n>" once listening on 127.0.0.1

For the upstream tests (tests/integration/dispatch/test_upstream.py) it can act as a server with
a short batch: HF_MAX_RUNNING=N lets N requests generate at once and the others wait, and
GET /metrics reports them as vLLM's `vllm:num_requests_waiting` / `running` gauges, plus the most
requests it ever held at once (`hf:max_requests_present`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = sys.argv[1]
TOKENIZER = AutoTokenizer.from_pretrained(MODEL_DIR)
MODEL = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
EOS = set(MODEL.generation_config.eos_token_id or [])
FORWARD_LOCK = threading.Lock()  # one forward at a time; requests interleave between tokens
MAX_RUNNING = int(os.environ.get("HF_MAX_RUNNING", "0"))  # 0 = no limit
RUN_SLOTS = threading.Semaphore(MAX_RUNNING) if MAX_RUNNING else None
STATE_LOCK = threading.Lock()
STATE = {"waiting": 0, "running": 0, "max_present": 0}


def _count(waiting: int, running: int) -> None:
    with STATE_LOCK:
        STATE["waiting"] += waiting
        STATE["running"] += running
        STATE["max_present"] = max(STATE["max_present"], STATE["waiting"] + STATE["running"])


def greedy_tokens(prompt_ids: list[int], max_tokens: int, ignore_eos: bool):
    ids = torch.tensor([prompt_ids])
    past = None
    with torch.no_grad():
        for _ in range(max_tokens):
            with FORWARD_LOCK:
                out = MODEL(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            yield token
            if token in EOS and not ignore_eos:
                return
            ids = torch.tensor([[token]])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _sse(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        body = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/metrics":
            with STATE_LOCK:
                body = (f"# TYPE vllm:num_requests_waiting gauge\n"
                        f'vllm:num_requests_waiting{{model_name="demo"}} {STATE["waiting"]}\n'
                        f"# TYPE vllm:num_requests_running gauge\n"
                        f'vllm:num_requests_running{{model_name="demo"}} {STATE["running"]}\n'
                        f"# TYPE hf:max_requests_present gauge\n"
                        f'hf:max_requests_present {STATE["max_present"]}\n').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path != "/v1/models":
            self.send_error(404)
            return
        body = b'{"object": "list", "data": [{"id": "demo", "object": "model"}]}'
        self.send_response(200 if self.headers.get("Authorization") == "Bearer test-key" else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self.send_error(404)
            return
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # drain: keep-alive
        if self.headers.get("Authorization") != "Bearer test-key":
            body = b'{"error": {"message": "bad key", "type": "invalid_request_error"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        request = json.loads(raw)
        if chat:
            prompt_ids = TOKENIZER.apply_chat_template(request["messages"], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
        elif isinstance(request["prompt"], list):  # token ids, as OpenAI's API allows
            prompt_ids = [int(t) for t in request["prompt"]]
        else:
            prompt_ids = TOKENIZER.encode(request["prompt"])
        prompt_ids = list(prompt_ids)
        _count(1, 0)
        if RUN_SLOTS is not None:
            RUN_SLOTS.acquire()
        _count(-1, 1)
        try:
            self._generate(request, chat, prompt_ids)
        finally:
            _count(0, -1)
            if RUN_SLOTS is not None:
                RUN_SLOTS.release()

    def _generate(self, request: dict, chat: bool, prompt_ids: list[int]) -> None:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        generated: list[int] = []
        text_so_far = ""
        finish = "length"
        tier = request.get("service_tier") or "default"
        for token in greedy_tokens(prompt_ids, int(request.get("max_tokens", 16)),
                                   bool(request.get("ignore_eos"))):
            generated.append(token)
            text = TOKENIZER.decode(generated, skip_special_tokens=True)
            piece, text_so_far = text[len(text_so_far):], text
            if token in EOS and not request.get("ignore_eos"):
                finish = "stop"
                break
            piece = piece or " "  # a token that completes no character still is a token event
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self._sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": request["model"], "service_tier": tier, "choices": [choice]})
        final = {"index": 0, "finish_reason": finish, **({"delta": {}} if chat else {"text": ""})}
        self._sse({"id": rid, "model": request["model"], "service_tier": tier, "choices": [final]})
        self._sse({"id": rid, "model": request["model"], "choices": [],
                   "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generated),
                             "total_tokens": len(prompt_ids) + len(generated)}})
        self._sse("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
