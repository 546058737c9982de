"""`sluice bench routing-replay`: a routing run's arrivals through the product's Router against
modelled workers (hand-made runs; the bench itself runs real workers)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pytest

from sluice.errors import CLIError
from sluice_lab.experiments.routing_replay import ModelWorker, arrivals_of, replay, run_replay_command

pytestmark = pytest.mark.unit


def run_result(*, turns: int = 60, tenants: int = 6) -> dict[str, Any]:
    """A routing run's JSON as the bench writes it: half the arrivals from the hot tenant, each
    turn 192 tokens longer than its conversation's last."""
    rng = random.Random(1)
    contexts = {t: rng.randrange(1000, 2000) for t in ["hot"] + [f"tenant-{i:02d}" for i in range(1, tenants)]}
    depth: dict[tuple[str, int], int] = {}
    rows = []
    for i in range(turns):
        tenant = "hot" if rng.random() < 0.5 else rng.choice(list(contexts)[1:])
        conversation = rng.randrange(3)
        turn = depth.get((tenant, conversation), 0)
        depth[(tenant, conversation)] = turn + 1
        rows.append({"policy": "cache_aware", "phase": "arrivals", "tenant": tenant, "hot": tenant == "hot",
                     "conversation": conversation, "arrival": 1000.0 + 2.5 * i,
                     "prompt_tokens": contexts[tenant] + 64 + 192 * turn, "output_tokens": 128,
                     "cached_tokens": contexts[tenant]})
    return {"config": {"workers": 3, "max_num_seqs": 4, "user_tokens": 64}, "worker_cpu_s": 300.0,
            "turns": rows}


def test_cache_aware_prefills_less_than_least_loaded_and_routes_every_arrival() -> None:
    arrivals = arrivals_of(run_result())
    assert sum(not a.measured for a in arrivals) == 6  # one warm-up per tenant, before the measured
    rows = {p: replay(arrivals, policy=p, workers=3, max_num_seqs=4, work_per_s=30.0)
            for p in ("least_loaded", "cache_aware")}
    for row in rows.values():
        assert sum(row["requests_per_worker"].values()) == 60
    assert rows["cache_aware"]["prefilled_tokens"] < rows["least_loaded"]["prefilled_tokens"] / 2
    assert rows["cache_aware"]["big_prefills"] < rows["least_loaded"]["big_prefills"]
    assert rows["cache_aware"]["max_work_share_over_even"] <= 1.25  # the share guard spread the hot prefix
    assert sum(n > 0 for n in rows["cache_aware"]["hot_requests_per_worker"].values()) >= 2


def test_a_modelled_worker_shares_its_rate_between_the_requests_in_flight() -> None:
    worker = ModelWorker("w0", max_num_seqs=4, remaining=[10.0, 30.0])
    assert worker.load == 0.5
    worker.serve(1.0, work_per_s=20.0)  # 10 each: the first ends
    assert worker.remaining == [20.0]
    worker.serve(0.5, work_per_s=20.0)  # alone now: 10 more
    assert worker.remaining == [10.0]


@pytest.mark.parametrize("content", ["not json", "[1, 2]", json.dumps({"turns": []}), json.dumps({"config": 5}),
                                     json.dumps({"turns": ["x"]}),
                                     json.dumps({"turns": [{"policy": "cache_aware", "phase": "arrivals"}]}),
                                     json.dumps({"turns": [{"policy": "cache_aware", "phase": "arrivals",
                                                            "tenant": "a", "conversation": 0, "arrival": 1.0,
                                                            "prompt_tokens": 100, "output_tokens": 1,
                                                            "cached_tokens": 0}]})])
def test_a_file_that_is_not_a_routing_run_is_a_one_line_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "run.json"
    path.write_text(content)
    args = argparse.Namespace(result=path, workers=None, max_num_seqs=None, policy=None, seed=0, json_out=None)
    with pytest.raises(CLIError) as raised:
        run_replay_command(args)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("flags", [dict(workers=0), dict(max_num_seqs=0), dict(workers=-2)])
def test_no_workers_or_slots_is_a_one_line_error(tmp_path: Path, flags: dict[str, int]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run_result()))
    args = argparse.Namespace(**{"result": path, "workers": None, "max_num_seqs": None, "policy": None, "seed": 0,
                                 "json_out": None, **flags})
    with pytest.raises(CLIError, match="must be positive"):
        run_replay_command(args)
