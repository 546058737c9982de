"""Settings: defaults, environment overrides, and one clear error for every kind of bad config."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.settings import load_settings

pytestmark = pytest.mark.unit

REPO_CONFIG = Path(__file__).resolve().parents[3] / "config"


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    target = tmp_path / "config"
    shutil.copytree(REPO_CONFIG, target)
    return target


def test_shipped_config_loads_with_fifty_tenants_of_every_class(config_dir: Path) -> None:
    settings = load_settings(config_dir, environ={})
    assert len(settings.tenants) == 50
    assert {t.priority_ceiling for t in settings.tenants} == {"interactive", "standard", "batch"}
    assert any(t.name == "demo-chat" for t in settings.tenants)
    real, demo = settings.models  # the real chat model by default, the demo one for --demo
    assert (real.name, real.fetch, real.demo) == ("smollm2-135m-instruct", "smollm2", False)
    assert demo.demo is True and demo.fetch is None
    assert settings.kafka.enable_idempotence is False


def test_environment_overrides_use_one_prefix(config_dir: Path) -> None:
    env = {
        "SLUICE_GATEWAY_PORT": "9123",
        "SLUICE_DATABASE_URL": "postgresql+asyncpg://u@h/db",
        "SLUICE_KAFKA_BOOTSTRAP_SERVERS": "kafka-1:9092,kafka-2:9092",
        "SLUICE_KAFKA_ENABLE_IDEMPOTENCE": "true",
        "SLUICE_ADMIN_TOKEN": "not-a-toml-literal-so-a-string",
        "SLUICE_ENGINE_MAX_NUM_SEQS": "8",
        "SLUICE_TEST_SOMETHING": "ignored: no such section",
    }
    settings = load_settings(config_dir, environ=env)
    assert settings.gateway.port == 9123
    assert settings.database.url == "postgresql+asyncpg://u@h/db"
    assert settings.kafka.bootstrap_servers == "kafka-1:9092,kafka-2:9092"
    assert settings.kafka.enable_idempotence is True
    assert settings.admin.token == "not-a-toml-literal-so-a-string"
    assert settings.engine["max_num_seqs"] == 8


def test_config_dir_from_environment(config_dir: Path) -> None:
    settings = load_settings(environ={"SLUICE_CONFIG_DIR": str(config_dir)})
    assert settings.config_dir == str(config_dir)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(environ={"SLUICE_CONFIG_DIR": str(config_dir / "nope")})


@pytest.mark.parametrize(
    ("filename", "content", "expected"),
    [
        ("sluice.toml", "[gateway\nport = 1", r"sluice\.toml: not valid TOML"),
        ("sluice.toml", "[gateway]\nport = 'eighty'", r"sluice\.toml.*Expected `int`.*\$\.gateway\.port"),
        ("sluice.toml", "[gateway]\nprot = 80", r"sluice\.toml: unknown key 'prot' in \[gateway\]"),
        ("sluice.toml", "[gatewy]\nport = 80", r"sluice\.toml: unknown section \[gatewy\]"),
        ("sluice.toml", "gateway = 3", r"gateway must be a table"),
        ("sluice.toml", "[gateway]\nport = 70000", r"\[gateway\] port must be 0\.\.65535"),
        ("sluice.toml", "[engine]\npolicy = 'fastest'", r"\[engine\] policy must be one of"),
        ("sluice.toml", "[engine]\nmodel = 'x'", r"set per worker"),
        ("sluice.toml", "[engine]\nblock_size = 12", r"block_size must be a power of two"),
        ("sluice.toml", "[shared]\nurl = 'http://x'", r"sluice\.toml: \[shared\] url must start with redis://"),
        ("sluice.toml", "[shared]\nurl = 'redis://h:99999'", r"\[shared\] url has a port that is not 1\.\.65535"),
        ("sluice.toml", "[shared]\nurl = 'redis:///0'", r"\[shared\] url names no host"),
        ("sluice.toml", "[shared]\nurl = 'redis://h/zero'", r"\[shared\] url: the database .* must be a number"),
        ("sluice.toml", "[shared]\nurl = 5", r"sluice\.toml.*Expected `str`.*\$\.shared\.url"),
        ("sluice.toml", "[shared]\nlease_s = 0", r"\[shared\] lease_s must be positive"),
        ("sluice.toml", "[shared]\nprefix = ''", r"\[shared\] prefix must be non-empty"),
        ("sluice.toml", "[kafka]\nsession_timeout_ms = 900", r"\[kafka\] heartbeat_interval_ms must be .* below"),
        ("sluice.toml", "[routing]\nbalance_margin = -0.1", r"sluice\.toml.*balance_margin must be 0 or more"),
        ("sluice.toml", "[routing]\nbalance_margin = nan", r"sluice\.toml.*balance_margin must be 0 or more"),
        ("sluice.toml", "[routing]\nbalance_margin = 'even'", r"sluice\.toml.*Expected `float`.*balance_margin"),
        ("tenants.toml", "[[tenants]]\nname = 'a'\nweight = 0", r"tenants\.toml: tenant 'a': weight must be positive"),
        ("tenants.toml", "[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'a'", r"empty or repeated"),
        ("tenants.toml", "[[tenants]]\nname = 'a'\npriority_ceiling = 'vip'", r"tenants\.toml.*\$\.tenants\[0\]"),
        ("tenants.toml", "[[tenants]]\nname = 'a'\n[tenants.quotas]\nmax_queued = -1", r"quotas\.max_queued"),
        ("tenants.toml", "[[tenants]]\nname = 'a'\nallowed_models = ['gpt-9']", r"unknown model"),
        ("tenants.toml", "tenant = 1", r"expected \[\[tenants\]\]"),
        ("models.toml", "[[models]]\nname = 'm'", r"models\.toml.*path"),
        ("models.toml", "[[models]]\nname = 'm'\npath = 'p'\nfetch = 'gpt-17'", r"models\.toml.*'gpt-17'.*smollm2"),
        ("models.toml", "[[models]]\nname = 'm'\npath = 'p'\nfetch = 'smollm2'\ndemo = true", r"not both"),
    ],
)
def test_bad_config_names_file_key_and_problem(config_dir: Path, filename: str, content: str, expected: str) -> None:
    (config_dir / filename).write_text(content)
    with pytest.raises(ConfigError, match=expected):
        load_settings(config_dir, environ={})


def test_bad_environment_override_names_the_variable(config_dir: Path) -> None:
    with pytest.raises(ConfigError, match="SLUICE_GATEWAY_PROT: unknown key 'prot'"):
        load_settings(config_dir, environ={"SLUICE_GATEWAY_PROT": "1"})
    with pytest.raises(ConfigError, match=r"environment.*Expected `int`"):
        load_settings(config_dir, environ={"SLUICE_GATEWAY_PORT": "abc"})


def test_shared_url_from_environment_and_its_errors_are_one_line_without_secrets(config_dir: Path) -> None:
    assert load_settings(config_dir, environ={}).shared.url == ""  # in-process by default
    settings = load_settings(config_dir, environ={"SLUICE_SHARED_URL": "redis://127.0.0.1:6379/0"})
    assert settings.shared.url == "redis://127.0.0.1:6379/0"
    for garbage in ("mysql://:hunter2@db/1", "redis://:hunter2@host:port/0", "\x00\x01", "redis://:hunter2@/0"):
        with pytest.raises(ConfigError, match=r"SLUICE_SHARED_\*.*\[shared\] url") as caught:
            load_settings(config_dir, environ={"SLUICE_SHARED_URL": garbage})
        assert "\n" not in str(caught.value) and "hunter2" not in str(caught.value)


def test_binary_garbage_is_a_clear_error(config_dir: Path) -> None:
    (config_dir / "sluice.toml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"sluice\.toml"):
        load_settings(config_dir, environ={})


def test_error_names_the_environment_once_with_several_overrides(config_dir: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(config_dir, environ={"SLUICE_GATEWAY_PORT": "x", "SLUICE_GATEWAY_HOST": "h"})
    assert str(caught.value).count("environment") == 1
