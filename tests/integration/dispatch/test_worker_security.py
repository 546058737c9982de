"""The worker port: only a peer that proves the worker secret is a worker; a live worker is never
evicted by a newcomer under its id; TLS when configured. Real sockets, a real worker process, a
real KafkaBackend on the session broker."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from sluice_testing import submit

from sluice.broker import free_port
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.protocol import (
    FinishReason,
    FrameDecoder,
    GenerateRequest,
    Message,
    Priority,
    SamplingParams,
    ServedModelInfo,
    WorkerCapacity,
    WorkerChallenge,
    WorkerRegister,
    WorkerRejected,
    encode_frame,
    read_opening,
    worker_proof,
)
from sluice.settings import GatewaySettings

from .conftest import WORKER_SECRET, make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def request(n: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"sec-{n}-{time.monotonic_ns()}", tenant_id="tenant-secret-id", model="demo",
        priority=Priority.STANDARD, prompt_token_ids=tuple(range(5, 17)),
        sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        cache_salt="tenant-secret-id", arrival_time=time.time())


def register(worker_id: str, proof: str) -> WorkerRegister:
    capacity = WorkerCapacity(worker_id=worker_id, num_running=0, num_waiting=0, free_kv_blocks=100,
                              total_kv_blocks=100, max_num_seqs=8, sent_at=time.time())
    return WorkerRegister(worker_id=worker_id, models=(ServedModelInfo(name="demo", max_model_len=100_000),),
                          device="cpu", pid=1, capacity=capacity, proof=proof)


async def impostor(port: int, make: object, *, context: ssl.SSLContext | None = None) -> list[Message]:
    """Connects like a worker, answers the challenge with `make(nonce)` and returns every message
    the gateway sent until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    decoder = FrameDecoder()
    try:
        received = await asyncio.wait_for(read_opening(reader, decoder), 30)
        challenge = received[0]
        assert isinstance(challenge, WorkerChallenge)
        reply = make(challenge.nonce)  # type: ignore[operator]
        writer.write(reply if isinstance(reply, bytes) else encode_frame(reply))
        while data := await asyncio.wait_for(reader.read(1 << 16), 30):
            received += decoder.feed(data)
    finally:
        writer.close()
    return received


async def test_only_a_peer_with_the_secret_is_a_worker_and_a_live_worker_is_never_evicted(
        bootstrap_servers: str, demo_model_dir: Path, start_worker, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    backend = KafkaBackend(make_settings(bootstrap_servers, demo_model_dir), worker_port=port)
    await backend.start()
    caplog.set_level(logging.INFO, logger="sluice.gateway.dispatch.dispatcher")
    try:
        queued = await submit(backend, request(0))  # waits for a worker: an impostor must not get it
        wrong = "x" * len(WORKER_SECRET)
        attempts = {
            "no proof": lambda nonce: register("intruder", ""),
            "wrong secret": lambda nonce: register("intruder", worker_proof(wrong, nonce, "intruder")),
            "proof replayed for another id": lambda nonce: register(
                "intruder", worker_proof(WORKER_SECRET, nonce, "someone-else")),
            "not a registration": lambda nonce: request(99),
            "garbage": lambda nonce: b"\x00\x00\x00\x05hello",
            "huge frame": lambda nonce: b"\x7f\xff\xff\xff",
        }
        for what, make in attempts.items():
            received = await impostor(port, make)
            kinds = [type(m).__name__ for m in received]
            assert kinds == ["WorkerChallenge", "WorkerRejected"], (what, kinds)
            assert not backend.dispatcher.workers, what
        assert backend.dispatcher.worker_port.rejected_connections == len(attempts)
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == len(attempts)
        assert all(WORKER_SECRET not in r.getMessage() for r in caplog.records)

        worker = start_worker(demo_model_dir, port, "sw1", "--max-num-seqs", "4")
        await wait_for(lambda: "sw1" in backend.dispatcher.workers, 180, "the real worker to register")
        live = backend.dispatcher.workers["sw1"]
        deltas = [d async for d in queued]
        assert deltas[-1].finish_reason == FinishReason.LENGTH

        # The right secret but a live worker's id: refused, and the live worker keeps serving.
        received = await impostor(port, lambda nonce: register("sw1", worker_proof(WORKER_SECRET, nonce, "sw1")))
        assert [type(m) for m in received] == [WorkerChallenge, WorkerRejected]
        assert "already connected" in received[1].reason  # type: ignore[union-attr]
        assert backend.dispatcher.workers["sw1"] is live
        sub = await submit(backend, request(1))
        deltas = await asyncio.wait_for(_drain(sub), 120)
        assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].num_output_tokens == 4
        assert worker.poll() is None
    finally:
        await backend.stop()


async def _drain(sub) -> list:
    return [d async for d in sub]


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "worker-port.pem", directory / "worker-port.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_worker_port_over_tls(bootstrap_servers: str, demo_model_dir: Path, start_worker,
                                    tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    settings = make_settings(bootstrap_servers, demo_model_dir, gateway=GatewaySettings(
        worker_port=0, worker_secret=WORKER_SECRET, worker_tls_cert=str(cert), worker_tls_key=str(key)))
    backend = KafkaBackend(settings, worker_port=port)
    await backend.start()
    try:
        # A plain-TCP peer gets no challenge, let alone a request.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01hello")
        assert b"challenge" not in await asyncio.wait_for(reader.read(1 << 16), 30)
        writer.close()
        start_worker(demo_model_dir, port, "tls1", extra_env={"SLUICE_GATEWAY_WORKER_TLS_CA": str(cert)})
        await wait_for(lambda: "tls1" in backend.dispatcher.workers, 180, "the TLS worker to register")
        sub = await submit(backend, request(2))
        deltas = await asyncio.wait_for(_drain(sub), 120)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        # Over TLS, the secret is still required.
        context = ssl.create_default_context(cafile=str(cert))
        received = await impostor(port, lambda nonce: register("x", ""), context=context)
        assert [type(m) for m in received] == [WorkerChallenge, WorkerRejected]
    finally:
        await backend.stop()


async def test_workers_announce_what_they_serve(bootstrap_servers: str, demo_model_dir: Path, start_worker) -> None:
    """A model is served once a worker announced it (then also while its workers are down); a worker
    with another tokenizer or a shorter context for that name is refused; the gateway answers 404
    model_not_found for a model no worker announced."""
    from sluice.gateway.auth.service import TenantContext
    from sluice.gateway.edge.errors import OpenAIError
    from sluice.gateway.edge.schemas import ChatCompletionRequest
    from sluice.gateway.generation.service import GenerationService
    from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
    from sluice.gateway.quotas.service import QuotaLimits, QuotaService
    from sluice.protocol import tokenizer_identity
    from sluice.settings import DispatchSettings

    from .conftest import terminate_group

    port = free_port()
    settings = make_settings(bootstrap_servers, demo_model_dir, dispatch=DispatchSettings(
        heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, local_workers=0, announce_grace_s=0.0))
    backend = KafkaBackend(settings, worker_port=port)
    await backend.start()
    try:
        registry = TokenizerRegistry()
        registry.add(ModelTokenizer.load("demo", demo_model_dir))
        generation = GenerationService(backend, registry, QuotaService(), None)  # type: ignore[arg-type]
        tenant = TenantContext(id="t", name="t", priority_ceiling=Priority.INTERACTIVE,
                               default_class=Priority.STANDARD, weight=1.0, allowed_models=frozenset(),
                               enabled=True, limits=QuotaLimits())
        body = msgspec.convert({"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
                               ChatCompletionRequest)
        with pytest.raises(OpenAIError) as missing:
            await generation.prepare(tenant, body)
        assert missing.value.status == 404 and missing.value.code == "model_not_found"

        expected = backend.dispatcher.expected_models["demo"]
        assert expected.tokenizer == tokenizer_identity(demo_model_dir) != ""

        def announcing(info: ServedModelInfo):
            def make(nonce: bytes) -> WorkerRegister:
                reg = register("odd", worker_proof(WORKER_SECRET, nonce, "odd"))
                return msgspec.structs.replace(reg, models=(info,))
            return make

        wrong = (ServedModelInfo(name="demo", max_model_len=10**6, tokenizer="0" * 64), "tokenizer")
        short = (ServedModelInfo(name="demo", max_model_len=8, tokenizer=expected.tokenizer), "max_model_len")
        unknown = (ServedModelInfo(name="other", max_model_len=10**6), "does not list")
        for info, why in (wrong, short, unknown):
            received = await impostor(port, announcing(info))
            assert isinstance(received[-1], WorkerRejected) and why in received[-1].reason, (why, received)
        assert not backend.could_serve("demo")

        worker = start_worker(demo_model_dir, port, "aw1")
        await wait_for(lambda: "aw1" in backend.dispatcher.workers, 180, "the worker to register")
        assert backend.could_serve("demo")
        prepared = await generation.prepare(tenant, body)
        assert prepared.request.model == "demo"
        terminate_group(worker)
        await wait_for(lambda: "aw1" not in backend.dispatcher.workers, 60, "the worker to be gone")
        assert backend.could_serve("demo")  # temporarily down: its requests wait for a worker
    finally:
        await backend.stop()
