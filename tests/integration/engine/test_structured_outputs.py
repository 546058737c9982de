"""Constrained decoding in the engine, on the demo model (random weights: only the grammar can make
its output valid): every policy with speculation on and off, preemption, resumed requests,
max_tokens mid-object, compile failures and time limits, logit_bias, logprobs under a mask."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import jsonschema
import pytest

from sluice.protocol import FinishReason, RequestDelta, SamplingParams, StructuredOutput
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = pytest.mark.integration

# Nested (lists of objects, enums, optional fields), every string and array bounded so that an
# answer fits in max_tokens whatever a random model picks.
SCHEMA = {
    "$defs": {"Part": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "kind": {"enum": ["bolt", "nut", "gear"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        },
        "required": ["name", "kind", "count"],
        "additionalProperties": False,
    }},
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 8},
        "level": {"enum": ["low", "high"]},
        "parts": {"type": "array", "items": {"$ref": "#/$defs/Part"}, "maxItems": 2},
        "done": {"type": "boolean"},
    },
    "required": ["title", "level", "parts"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
PROMPTS = ["The keeper writes the level", "hello there", "a b c d e f", "Numbers: 1 2 3"]


def _engine(model: Path, **options) -> LLMEngine:
    base = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=128, max_num_seqs=8)
    return LLMEngine(EngineConfig(model=str(model), **(base | options)))


def _sampling(seed: int | None, **options) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=0.0 if seed is None else 1.0, seed=seed,
                          structured=JSON_SPEC, **options)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("speculation", [0, 4], ids=["spec-off", "spec-on"])
@pytest.mark.parametrize("policy", ["chunked", "prefill_first", "static"])
def test_every_output_is_schema_valid(demo_model_dir: Path, policy: str, speculation: int) -> None:
    engine = _engine(demo_model_dir, policy=policy, num_speculative_tokens=speculation)
    params = [_sampling(seed) for seed in range(20)] + [_sampling(None)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    for result in engine.generate(prompts, params):
        assert result.finish_reason == FinishReason.STOP, result.text
        _valid(result.text)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = engine.generate(PROMPTS, plain)
    mixed = engine.generate(PROMPTS * 2, [plain] * 4 + [_sampling(s) for s in range(4)])
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in alone]
    for result in mixed[4:]:
        _valid(result.text)


def test_preemption_keeps_greedy_output_identical(demo_model_dir: Path) -> None:
    undisturbed = _engine(demo_model_dir).generate(PROMPTS, _sampling(None))
    # Few blocks for eight sequences: requests are preempted (recomputed) on the way.
    tight = _engine(demo_model_dir, num_kv_blocks=10, num_speculative_tokens=0)
    results = tight.generate(PROMPTS, _sampling(None))
    assert tight.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in undisturbed]
    for result in results:
        _valid(result.text)


def _run(engine: LLMEngine, rid: str, sampling: SamplingParams, resume: list[int] | None = None,
         ) -> list[RequestDelta]:
    engine.add_request(rid, PROMPTS[0], sampling, resume_token_ids=resume or ())
    deltas = []
    while engine.has_work:
        deltas.extend(d for d in engine.step() if d.request_id == rid)
    return deltas


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_resumed_request_rebuilds_its_matcher(demo_model_dir: Path, seed: int | None) -> None:
    """Worker failover resends the delivered tokens: the matcher is rebuilt from them and the
    request ends exactly as the undisturbed run did."""
    engine = _engine(demo_model_dir, num_speculative_tokens=0)
    undisturbed = _run(engine, "u", _sampling(seed))
    ids = [t for d in undisturbed for t in d.token_ids]
    text = "".join(d.text for d in undisturbed)
    _valid(text)
    for k in (1, len(ids) // 2, len(ids) - 1):
        resumed = _run(engine, f"r{k}", _sampling(seed), ids[:k])
        assert [t for d in resumed for t in d.token_ids] == ids[k:]
        assert resumed[-1].finish_reason == FinishReason.STOP


def test_resume_tokens_the_grammar_refuses_fail_that_request(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    bad = engine.tokenize("nope")
    deltas = _run(engine, "bad", _sampling(None), bad)
    assert deltas[-1].finish_reason == FinishReason.ERROR and "cannot be enforced" in (deltas[-1].error or "")


def test_max_tokens_mid_object_ends_with_length(demo_model_dir: Path) -> None:
    sampling = SamplingParams(max_tokens=5, temperature=0.0, structured=JSON_SPEC)
    result = _engine(demo_model_dir).generate([PROMPTS[0]], sampling)[0]
    assert result.finish_reason == FinishReason.LENGTH
    assert len(result.token_ids) == 5 and result.text.startswith("{")


@pytest.mark.parametrize(("kind", "spec", "check"), [
    ("regex", r"[a-c]{2}-\d{3}", lambda t: len(t) == 6 and t[2] == "-" and t[3:].isdigit()),
    ("choice", '["red", "green", "blue"]', lambda t: t in ("red", "green", "blue")),
    ("grammar", 'start: "(" num ")"\nnum: /[0-9]{1,3}/', lambda t: t[0] == "(" and t[-1] == ")"),
    ("tagged", json.dumps({"begin": "<call>", "schema": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
        "additionalProperties": False}, "end": "</call>", "repeat": False}),
     lambda t: t.startswith("<call>") and t.endswith("</call>") and json.loads(t[6:-7])["x"] in range(10)),
])
def test_other_kinds(demo_model_dir: Path, kind: str, spec: str, check) -> None:
    engine = _engine(demo_model_dir)
    structured = StructuredOutput(kind=kind, spec=spec)  # type: ignore[arg-type]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=structured) for s in range(6)]
    for result in engine.generate(PROMPTS[:2] * 3, params):
        assert result.finish_reason == FinishReason.STOP
        assert check(result.text), result.text


def test_a_failing_or_slow_compile_fails_that_request_alone(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    bad = SamplingParams(max_tokens=20, structured=StructuredOutput(kind="json", spec='{"type": "strin"}'))
    ok = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = engine.generate([PROMPTS[0], PROMPTS[1]], [bad, ok])
    assert results[0].finish_reason == FinishReason.ERROR
    assert results[1].finish_reason == FinishReason.LENGTH and len(results[1].token_ids) == 8

    slow = _engine(demo_model_dir, grammar_compile_timeout_s=1e-9)
    slow.grammar_compiler.submit(JSON_SPEC).result()  # the token table is built: limits count from now
    # Every compile thread is held (a stand-in for compiles that take long: how long a real one takes
    # depends on the machine, so the test holds the threads itself); the request's own grammar queues
    # behind them and cannot be ready within the limit.
    release = threading.Event()
    pool = slow.grammar_compiler._pool
    for _ in range(pool._max_workers):
        pool.submit(release.wait, 60)
    try:
        engine_deltas = _run(slow, "slow", SamplingParams(max_tokens=20, structured=StructuredOutput(
            kind="regex", spec="[a-z]{1,9}x")))
    finally:
        release.set()
    assert engine_deltas[-1].finish_reason == FinishReason.ERROR
    assert "did not compile within" in (engine_deltas[-1].error or "")
    assert slow.generate([PROMPTS[1]], ok)[0].finish_reason == FinishReason.LENGTH  # the engine goes on


def test_logit_bias(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = engine.generate([PROMPTS[0]], plain)[0].token_ids
    forced = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logit_bias=((42, 100.0),)))[0].token_ids
    assert forced == [42] * 6
    banned = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logit_bias=((base[0], -100.0),)))[0].token_ids
    assert banned[0] != base[0]
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", PROMPTS[0], SamplingParams(logit_bias=((10**6, 1.0),)))


def test_logprobs_describe_the_masked_distribution(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    choice = StructuredOutput(kind="choice", spec='["yes", "no"]')
    result = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0, logprobs=True,
                                                          top_logprobs=5, structured=choice))[0]
    assert result.text in ("yes", "no")
    first = result.logprobs[0]
    assert math.isfinite(first.chosen.logprob)
    # Only the grammar's allowed first tokens have finite logprobs, and they sum to 1.
    finite = [t for t in first.top if math.isfinite(t.logprob)]
    assert 1 <= len(finite) <= 5
    assert sum(math.exp(t.logprob) for t in finite) == pytest.approx(1.0, abs=1e-4) or len(finite) == 5
