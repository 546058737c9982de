"""Scenario files: the shipped ones load; broken ones fail with file, key and problem."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from sluice_lab.loadgen.prompts import LengthDist, PromptFactory
from sluice_lab.loadgen.runner import arrival_offsets
from sluice_lab.loadgen.scenario import Arrival, Burst, Slo, Tenant, Workload, load_scenario

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[3] / "src" / "sluice_lab" / "scenarios"
KEY_VARS = ("SLUICE_BENCH_KEY_CHAT", "SLUICE_BENCH_KEY_RAG", "SLUICE_BENCH_KEY_AGENT",
            "SLUICE_BENCH_KEY_BATCH")

VALID = """
name = "t"
[[tenants]]
name = "a"
api_key = "sk-test"
[[workloads]]
tenant = "a"
arrival = { process = "poisson", rate = 2.0 }
prompt_tokens = { dist = "fixed", value = 10 }
output_tokens = { dist = "uniform", min = 1, max = 5 }
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["chat", "rag", "long-output", "translation-batch", "mixed"])
def test_shipped_scenarios_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in KEY_VARS:
        monkeypatch.setenv(var, f"sk-{var.lower()}")
    scenario = load_scenario(SCENARIOS / f"{name}.toml")
    assert scenario.name == name and scenario.workloads
    assert all(w.tenant.api_key.startswith("sk-") for w in scenario.workloads)


def test_valid_scenario_parses(tmp_path: Path) -> None:
    scenario = load_scenario(_write(tmp_path, VALID))
    [workload] = scenario.workloads
    assert workload.arrival == Arrival("poisson", rate=2.0)
    assert workload.output_tokens == LengthDist("uniform", low=1, high=5)
    assert "sk-test" not in repr(workload.tenant)  # keys never printed


@pytest.mark.parametrize(("text", "message"), [
    ("name = [unclosed", "not valid TOML"),
    ("bogus = 1\n" + VALID, "scenario.bogus: unknown key"),
    (VALID + "\nbogus = 1\n", "workloads[0].bogus: unknown key"),
    (VALID.replace("rate = 2.0", "rate = -1.0"), "workloads[0].arrival.rate: must be positive"),
    (VALID.replace("rate = 2.0", "rate = 2.0, cv = 3"), "workloads[0].arrival.cv: unknown key"),
    (VALID.replace('process = "poisson"', 'process = "weibull"'), "workloads[0].arrival.process: must be"),
    (VALID.replace('tenant = "a"', 'tenant = "b"'), "workloads[0].tenant: unknown tenant 'b'"),
    (VALID.replace("min = 1, max = 5", "min = 5, max = 1"), "output_tokens.max: must be at least min"),
    (VALID.replace('dist = "fixed", value = 10', 'dist = "fixed", value = 0'), "value: must be at least 1"),
    (VALID.replace('api_key = "sk-test"', 'api_key_env = "SLUICE_TEST_UNSET_VAR_XYZ"'),
     "SLUICE_TEST_UNSET_VAR_XYZ is not set"),
    ('name = "t"\n', "workloads: at least one"),
])
def test_broken_scenarios_name_file_key_and_problem(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=r"scenario\.toml") as info:
        load_scenario(path)
    assert message in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the scenario"):
        load_scenario(tmp_path / "nope.toml")


def test_length_file_distribution(tmp_path: Path) -> None:
    (tmp_path / "lengths.jsonl").write_text('{"n": 5}\n{"n": 9}\n', encoding="utf-8")
    text = VALID.replace('{ dist = "fixed", value = 10 }',
                         '{ dist = "file", path = "lengths.jsonl", field = "n" }')
    scenario = load_scenario(_write(tmp_path, text))
    assert scenario.workloads[0].prompt_tokens.values == (5, 9)
    (tmp_path / "lengths.jsonl").write_text('{"n": -1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"lengths.jsonl:1: 'n' must be a positive integer"):
        load_scenario(tmp_path / "scenario.toml")


def test_slo_parsing() -> None:
    assert Slo.parse("ttft=3s,itl=300ms") == Slo(ttft_s=3.0, itl_s=0.3)
    assert Slo.parse("itl=0.1") == Slo(ttft_s=3.0, itl_s=0.1)
    for bad in ("ttft=fast", "latency=3s", "ttft=-1s"):
        with pytest.raises(ValueError, match="--slo"):
            Slo.parse(bad)


def _workload(arrival: Arrival, **kw: object) -> Workload:
    one = LengthDist("fixed", value=1)
    return Workload(name="w", tenant=Tenant("a", ""), arrival=arrival, prompt_tokens=one, output_tokens=one,
                    **kw)


def test_arrivals_are_seeded_and_bursts_land_at_their_time() -> None:
    poisson = _workload(Arrival("poisson", rate=5.0))
    first = arrival_offsets(poisson, 100.0, random.Random(1))
    assert first == arrival_offsets(poisson, 100.0, random.Random(1))
    assert all(0 <= t < 100.0 for t in first) and first == sorted(first)
    assert 350 < len(first) < 650  # 500 expected; a wide band, the draw is fixed by the seed
    bursty = _workload(Arrival("gamma", rate=5.0, cv=3.0))
    gaps = np.diff(arrival_offsets(bursty, 200.0, random.Random(2)))
    assert np.std(gaps) / np.mean(gaps) > 2.0  # burstier than Poisson (CV 1)
    closed = _workload(Arrival("closed", concurrency=2), bursts=(Burst(3.0, 4),))
    assert arrival_offsets(closed, 10.0, random.Random(0)) == [3.0] * 4


def test_prompt_factory_calibrates_to_a_tokenizer(demo_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    factory = PromptFactory(str(demo_model_dir))
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    rng = random.Random(0)
    for target in (50, 500, 2000):
        n = len(tokenizer.encode(factory.make(target, rng), add_special_tokens=False).ids)
        assert 0.8 * target <= n <= 1.2 * target
