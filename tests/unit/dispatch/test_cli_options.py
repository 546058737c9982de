"""`sluice worker` builds its engine from the same settings as `sluice serve`: EngineConfig's
defaults, then [engine] (files and SLUICE_ENGINE_*), then its flags, then --engine-option."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.cli import build_parser
from sluice.errors import CLIError
from sluice.gateway.launch.cli import apply_engine_options, worker_setup
from sluice.gateway.launch.serve import check_engine_options
from sluice.settings import ModelSpec, Settings
from sluice.workers.config import EngineConfig
from sluice.workers.server import parse_address, parse_gateways

pytestmark = pytest.mark.unit


def _worker_args(model: Path, *flags: str):  # -> argparse.Namespace
    return build_parser().parse_args(["worker", "--model", str(model), "--gateway", "127.0.0.1:8100", *flags])


def test_worker_layers_defaults_settings_flags_and_engine_options(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "sluice.toml").write_text(
        "[engine]\nmax_num_seqs = 7\npolicy = \"prefill_first\"\nmax_num_batched_tokens = 300\n"
        "[dispatch]\nheartbeat_interval_s = 0.25\n")
    monkeypatch.setenv("SLUICE_CONFIG_DIR", str(config_dir))
    monkeypatch.setenv("SLUICE_GATEWAY_WORKER_SECRET", "s" * 32)
    monkeypatch.setenv("SLUICE_ENGINE_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("SLUICE_ENGINE_ENABLE_PREFIX_CACHING", "false")
    model = tmp_path / "my-model"
    model.mkdir()
    config, options = worker_setup(_worker_args(model, "--max-num-batched-tokens", "100",
                                                "--engine-option", "max_num_seqs=9"))
    defaults = EngineConfig(model="m")
    assert config.gpu_memory_utilization == 0.5 and config.enable_prefix_caching is False  # environment
    assert config.policy == "prefill_first"  # file
    assert config.max_num_batched_tokens == 100  # flag over file
    assert config.max_num_seqs == 9  # --engine-option over file
    assert config.block_size == defaults.block_size and config.kv_cache_bytes == defaults.kv_cache_bytes
    assert options.heartbeat_interval_s == 0.25 and options.model_name == "my-model"
    assert options.secret == "s" * 32
    flagged, _ = worker_setup(_worker_args(model, "--heartbeat-interval", "2", "--config", str(config_dir)))
    assert flagged.max_num_batched_tokens == 300


def test_engine_flags_left_unset_fall_back_to_engine_config(tmp_path: Path) -> None:
    from sluice.workers.cli import engine_config

    args = build_parser().parse_args(["generate", "--model", str(tmp_path), "--input", "i", "--output", "o"])
    assert engine_config(args, str(tmp_path)) == EngineConfig(model=str(tmp_path))


def test_unknown_or_malformed_engine_options_are_one_line_errors() -> None:
    with pytest.raises(CLIError, match="unknown engine setting 'bogus'"):
        apply_engine_options(EngineConfig(model="m"), ["bogus=1"])
    with pytest.raises(CLIError, match="KEY=VALUE"):
        apply_engine_options(EngineConfig(model="m"), ["max_num_seqs"])
    settings = Settings(models=(ModelSpec(name="m", path="m"),), engine={"max_num_seqs": 0})
    with pytest.raises(CLIError, match="max_num_seqs must be a positive integer"):
        check_engine_options(settings, "cpu")
    settings = Settings(models=(ModelSpec(name="m", path="m"),), engine={"nope": 1})
    with pytest.raises(CLIError, match="nope"):
        check_engine_options(settings, "cpu")


def test_gateway_address_parsing() -> None:
    assert parse_address("127.0.0.1:8100") == ("127.0.0.1", 8100)
    for bad in ("8100", "host:", "host:0", "host:99999", ":80"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)


def test_gateway_lists_parse_and_garbage_is_refused() -> None:
    assert parse_gateways("a:1,b:2, c:3") == (("a", 1), ("b", 2), ("c", 3))
    assert parse_gateways("[::1]:8100") == (("::1", 8100),)
    for bad, what in (("", "empty item"), ("a:1,", "empty item"), ("a:1,,b:2", "empty item"),
                      ("a:1,b:x", "HOST:PORT"), ("a:1,b:0", "HOST:PORT"), ("a:1,A:1", "twice")):
        with pytest.raises(ValueError, match=what):
            parse_gateways(bad)


def test_worker_command_rejects_bad_flags_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    assert main(["worker", "--model", str(tmp_path / "none"), "--gateway", "127.0.0.1:8100"]) == 2
    assert "model directory" in capsys.readouterr().err
    assert main(["worker", "--model", str(tmp_path), "--gateway", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["worker", "--model", str(tmp_path), "--gateway", "h:1,h:1"]) == 2
    err = capsys.readouterr().err
    assert "twice" in err and len(err.strip().splitlines()) == 1
    assert main(["worker", "--model", str(tmp_path), "--gateway", "h:1", "--heartbeat-interval", "0"]) == 2
    assert "--heartbeat-interval" in capsys.readouterr().err


def test_serve_picks_the_real_models_by_default_and_the_demo_ones_with_demo() -> None:
    from sluice.gateway.launch.serve import _selected_models

    real = ModelSpec(name="real", path="r", fetch="smollm2")
    demo = ModelSpec(name="demo", path="d", demo=True)
    assert _selected_models((real, demo), demo=False) == (real,)
    assert _selected_models((real, demo), demo=True) == (demo,)
    assert _selected_models((demo,), demo=False) == (demo,)  # nothing else listed: an offline setup
    with pytest.raises(CLIError, match="no model with demo = true"):
        _selected_models((real,), demo=True)
