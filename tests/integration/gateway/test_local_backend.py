"""LocalEngineBackend (the in-process engine behind the GenerationBackend seam) and the SSE error path."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from sluice_testing import drain, state_of, submit

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.db.migrate import migrate
from sluice.gateway.db.session import make_engine, make_session_factory
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
from sluice.gateway.queueing.backend import BackendUnavailable, GenerationBackend, Submission
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.gateway.quotas.service import QuotaLimits, QuotaService
from sluice.gateway.quotas.usage import UsageService
from sluice.gateway.streams.frames import Framer
from sluice.gateway.streams.hub import StreamHub
from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.protocol import FinishReason, GenerateRequest, Priority, SamplingParams

pytestmark = pytest.mark.integration


def request(rid: str, prompt: tuple[int, ...], max_tokens: int = 5, model: str = "demo") -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        tenant_id="t",
        model=model,
        priority=Priority.STANDARD,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        cache_salt="t",
        arrival_time=time.time(),
    )


async def test_submit_stream_abort_and_errors(demo_model_dir: Path, tmp_path: Path) -> None:
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 8, "kv_cache_bytes": 16 * 2**20})
    assert isinstance(backend, GenerationBackend)
    await backend.start()
    try:
        assert [m.name for m in backend.served_models()] == ["demo"]
        assert await backend.ready() == {"workers": True}
        sub = await submit(backend, request("a", (5, 6, 7), max_tokens=5))
        assert isinstance(sub.submission, Submission)
        deltas = await drain(sub)
        assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].num_output_tokens == 5
        assert sum(len(d.token_ids) for d in deltas) == 5

        long = await submit(backend, request("b", (5, 6, 7), max_tokens=2000))
        seen = 0
        async for delta in long:
            seen += len(delta.token_ids)
            if seen >= 2:
                await long.abort()
                await long.abort()  # idempotent
        assert delta.finish_reason is FinishReason.ABORT and delta.num_output_tokens < 2000

        # An invalid request ends with an error delta, never a hang.
        broken = await submit(backend, request("c", (10**6,)))
        final = (await drain(broken))[-1]
        assert final.finish_reason is FinishReason.ERROR and final.error

        with pytest.raises(BackendUnavailable):
            await submit(backend, request("d", (1,), model="other"))

        # The SSE path turns the error delta into an OpenAI error event, then ends.
        engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
        await migrate(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
        try:
            quotas = QuotaService()
            usage = UsageService(make_session_factory(engine))
            registry = TokenizerRegistry()
            registry.add(ModelTokenizer("demo", backend.tokenizer("demo"), 4096))
            service = GenerationService(backend, registry, quotas, usage)
            tenant = TenantContext(
                id="t",
                name="t",
                priority_ceiling=Priority.STANDARD,
                default_class=Priority.STANDARD,
                weight=1.0,
                allowed_models=frozenset(),
                enabled=True,
                limits=QuotaLimits(tokens_per_minute=10_000),
            )
            state = state_of(request("e", (10**6,)))
            state.reservation = reservation = await quotas.admit(tenant, 1, 5, Priority.STANDARD)
            flight = service.fly(state, tenant, await backend.submit(state))
            log = LocalStreamLog()
            await log.create("e", "t", None)
            hub = StreamHub(log, service.flights, service.spawn)
            hub.start(flight, Framer(state, registry.get("demo")), grace_s=30)
            events = b"".join([chunk async for chunk in hub.follow("e", -1)]).split(b"\n\n")
            error = msgspec.json.decode(events[-2].split(b"\n")[1].removeprefix(b"data: "))
            assert error["error"]["code"] == "generation_failed"
            assert reservation.done and quotas.live("t") == (0, 0)
            await service.drain()
        finally:
            await engine.dispose()
        snapshot = backend.snapshot()
        assert snapshot["workers"][0]["num_running"] == 0
    finally:
        await backend.stop()
