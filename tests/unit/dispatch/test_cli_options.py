"""`sluice serve` hands [engine] settings to its workers as --engine-option flags; round trip."""

from __future__ import annotations

import pytest

from sluice.errors import CLIError
from sluice.gateway.cli import apply_engine_options
from sluice.gateway.serve import check_engine_options, engine_option_args
from sluice.settings import ModelSpec, Settings
from sluice.workers.config import EngineConfig
from sluice.workers.server import parse_address

pytestmark = pytest.mark.unit


def test_engine_settings_round_trip_through_worker_flags() -> None:
    engine = {"policy": "prefill_first", "max_num_seqs": 7, "kv_cache_bytes": 1 << 20,
              "enable_prefix_caching": False, "gpu_memory_utilization": 0.5}
    args = engine_option_args(engine)
    options = [args[i + 1] for i in range(0, len(args), 2)]
    assert all(args[i] == "--engine-option" for i in range(0, len(args), 2))
    config = apply_engine_options(EngineConfig(model="m"), options)
    for key, value in engine.items():
        assert getattr(config, key) == value


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


def test_worker_command_rejects_bad_flags_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    assert main(["worker", "--model", str(tmp_path / "none"), "--gateway", "127.0.0.1:8100"]) == 2
    assert "model directory" in capsys.readouterr().err
    assert main(["worker", "--model", str(tmp_path), "--gateway", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["worker", "--model", str(tmp_path), "--gateway", "h:1", "--heartbeat-interval", "0"]) == 2
    assert "--heartbeat-interval" in capsys.readouterr().err


def test_serve_picks_the_real_models_by_default_and_the_demo_ones_with_demo() -> None:
    from sluice.gateway.serve import _selected_models

    real = ModelSpec(name="real", path="r", fetch="smollm2")
    demo = ModelSpec(name="demo", path="d", demo=True)
    assert _selected_models((real, demo), demo=False) == (real,)
    assert _selected_models((real, demo), demo=True) == (demo,)
    assert _selected_models((demo,), demo=False) == (demo,)  # nothing else listed: an offline setup
    with pytest.raises(CLIError, match="no model with demo = true"):
        _selected_models((real,), demo=True)
