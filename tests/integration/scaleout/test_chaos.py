"""Issue #16's chaos run, short: 2 replicas and 2 workers of the demo model (real processes, the
session's broker, PostgreSQL, Redis), streaming clients through `sluice.client.stream_chat` over
both replicas and a Batch API batch, while every few seconds a worker or a replica is SIGKILLed
and started again (a replica's open streams are taken over elsewhere, their clients re-attach).
Every stream completes with the undisturbed greedy text, every batch line comes back exactly
once with it. The run's figures are printed (`sluice bench chaos` is the long version)."""

from __future__ import annotations

import pytest

from sluice_lab.experiments.chaos import ChaosConfig, run_chaos
from sluice_lab.experiments.chaos_report import format_table, summarise
from sluice_lab.experiments.cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres]

# Streams over both replicas, so a SIGKILLed replica cuts streams in flight: replica takeover
# continues their generations elsewhere and the clients re-attach through the other replica.
CONFIG = ChaosConfig(duration_s=30.0, kill_every_s=6.0, kinds=("replica", "worker"), streams=4, batches=1,
                     batch_lines=40, prompts=4, max_tokens=24, seed=16, batch_timeout_s=300.0)


@pytest.fixture(scope="module")
def cluster_overrides() -> dict[str, object]:
    return {"replicas": 2, "workers": 2}


@pytest.mark.timeout(900)  # a cluster of 4 processes starts and restarts workers: slow on 2 shared cores
def test_streams_and_batch_lines_survive_sigkilled_replicas_and_workers(cluster: Cluster) -> None:
    stream_key = cluster.new_tenant("chaos-streams", priority_ceiling="interactive", default_class="interactive")[2]
    batch_key = cluster.new_tenant("chaos-batch", priority_ceiling="batch", default_class="batch")[2]
    outcome = run_chaos(cluster, stream_key, batch_key, CONFIG)
    summary = summarise(outcome)
    print("\n" + format_table(summary))
    kills = summary["kills"]
    assert kills["by_kind"].get("worker", 0) >= 1 and kills["by_kind"].get("replica", 0) >= 1, kills
    assert kills["restart_errors"] == 0, kills["list"]
    streams, lines = summary["streams"], summary["batch_lines"]
    assert streams["started"] >= CONFIG.streams
    assert streams["reconnected"] >= 1, streams  # a replica died under open streams
    assert streams["failed"] == 0, streams["failed_examples"]
    assert streams["divergent"] == 0, streams["divergent_examples"]
    assert lines["expected"] == CONFIG.batch_lines and lines["batches"][0]["status"] == "completed", lines
    assert (lines["lost"], lines["duplicated"], lines["failed"], lines["divergent"]) == (0, 0, 0, 0), lines
    assert summary["requests"]["completion_rate"] == 1.0
