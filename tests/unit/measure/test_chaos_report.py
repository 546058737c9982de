"""`sluice bench chaos`: its figures from hand-made outcomes (lost, duplicated, divergent lines and
texts, stalls, completion), the kill schedule's validation, and its garbage flags as one-line CLI
errors."""

from __future__ import annotations

import pytest

from sluice.cli import main
from sluice_lab.experiments.chaos import BatchRun, ChaosConfig, ChaosOutcome, Kill, StreamResult, check_cluster_fits
from sluice_lab.experiments.chaos_report import format_table, parse_kinds, passed, summarise

pytestmark = pytest.mark.unit


def outcome(streams: list[StreamResult], batches: list[BatchRun]) -> ChaosOutcome:
    return ChaosOutcome(ChaosConfig(duration_s=10), 2, 2, ["p0", "p1"], ["ref zero", "ref one"], streams,
                        [Kill(1.0, "worker", 0, 99, 2.0, 5.0), Kill(3.0, "replica", 1, 98, 4.0, 9.5)], 1,
                        batches, 12.0, (1.0, 2.0))


def stream(prompt: int, text: str, *, ok: bool = True, stall: float = 0.1, connections: int = 1) -> StreamResult:
    return StreamResult(0, prompt, 0.0, 1.0, text, ok, "" if ok else "StreamBroken: x", 0.2, stall, connections,
                        attaches=connections - 1)


def test_a_clean_run_passes() -> None:
    batch = BatchRun("batch_1", 0.5, {"a": 0, "b": 1}, "completed", 11.0, [("a", "ref zero"), ("b", "ref one")])
    summary = summarise(outcome([stream(0, "ref zero", stall=0.5), stream(1, "ref one", connections=3)], [batch]))
    assert summary["requests"] == {"started": 4, "completed": 4, "completion_rate": 1.0}
    assert summary["streams"]["divergent"] == 0 and summary["streams"]["reconnects"] == 2
    assert summary["streams"]["reconnected"] == 1 and summary["streams"]["reattached"] == 1
    assert len(summary["per_stream"]) == 2
    assert summary["streams"]["stall_s"]["max"] == 0.5
    assert summary["kills"]["by_kind"] == {"worker": 1, "replica": 1} and summary["kills"]["skipped"] == 1
    assert summary["kills"]["back_in_s"]["replica"]["max"] == pytest.approx(6.5)
    assert passed(summary)
    assert "PASS" in format_table(summary)


def test_lost_duplicated_divergent_and_failed_are_counted_apart() -> None:
    batch = BatchRun("batch_1", 0.5, {"a": 0, "b": 1, "c": 0, "d": 1}, "completed", 11.0,
                     [("a", "ref zero"), ("a", "ref zero"), ("b", "wrong"), ("d", None)])
    summary = summarise(outcome([stream(0, "ref zero"), stream(1, "ref on"), stream(0, "", ok=False)], [batch]))
    lines = summary["batch_lines"]
    assert (lines["expected"], lines["got"], lines["lost"], lines["duplicated"], lines["divergent"],
            lines["failed"]) == (4, 3, 1, 1, 1, 1)
    assert lines["batches"][0]["lost_ids"] == ["c"]
    streams = summary["streams"]
    assert streams["failed"] == 1 and streams["divergent"] == 1  # a failed stream is not also divergent
    assert streams["errors_by_type"] == {"StreamBroken": 1}
    assert summary["requests"]["started"] == 7 and summary["requests"]["completed"] == 4  # 2 streams, a, b
    assert not passed(summary)
    assert "FAIL" in format_table(summary)


def test_kinds_and_cluster_sizes() -> None:
    assert parse_kinds("replicas,workers") == ("replica", "worker")
    assert parse_kinds("worker") == ("worker",) and parse_kinds("none") == ()
    with pytest.raises(ValueError, match="--kill"):
        parse_kinds("gpus")
    with pytest.raises(ValueError, match="--workers 2 or more"):
        check_cluster_fits(ChaosConfig(kinds=("worker",)), 3, 1)
    check_cluster_fits(ChaosConfig(kinds=("replica",)), 2, 1)  # a lone worker is fine when only replicas die


@pytest.mark.parametrize("flags", [
    ["--duration-s", "-5"], ["--duration-s", "inf"], ["--kill-every-s", "0"], ["--kill", "everything"],
    ["--streams", "0"], ["--batch-lines", "-1"], ["--replicas", "1"], ["--workers", "0", "--kill", "replicas"],
    ["--redis-url", "http://example"], [],  # no --postgres-url
])
def test_garbage_flags_are_one_line_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "chaos", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sluice: error: ")


def test_a_flag_that_is_not_a_number_is_argparse_s_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "chaos", "--kill-every-s", "often"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage is above it
    assert last.startswith("sluice: error:") and "--kill-every-s" in last
