"""Settings: environment over file over defaults; bad values and unknown names fail naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from prewarm.core.errors import SettingsError
from prewarm.registry.connection import broker_url
from prewarm.core.settings import Settings


def test_defaults_and_environment(clean_env: pytest.MonkeyPatch) -> None:
    s = Settings.load()
    assert s.redis.url is None and s.gateway.port == 8080 and s.gateway.warm_threshold == 0.7
    clean_env.setenv("PREWARM_REDIS_URL", "redis://:pw@127.0.0.1:6390/2")
    clean_env.setenv("PREWARM_GATEWAY_PORT", "9001")
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["llama@r1"]')
    s = Settings.load()
    assert s.redis.url == "redis://:pw@127.0.0.1:6390/2" and s.gateway.port == 9001
    assert s.planner.models == ["llama@r1"]


def test_file_is_overridden_by_environment(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "prewarm.toml"
    cfg.write_text('[gateway]\nport = 7000\nhold_timeout_s = 2.5\n[redis]\nurl = "rediss://h:6380/0"\n')
    s = Settings.load(cfg)
    assert s.gateway.port == 7000 and s.gateway.hold_timeout_s == 2.5 and s.redis.url == "rediss://h:6380/0"
    clean_env.setenv("PREWARM_GATEWAY_PORT", "7001")
    clean_env.setenv("PREWARM_CONFIG", str(cfg))
    assert Settings.load().gateway.port == 7001
    yml = tmp_path / "prewarm.yaml"
    yml.write_text("registry:\n  heartbeat_interval_s: 2\n  heartbeat_ttl_s: 6\n")
    assert Settings.load(yml).registry.heartbeat_ttl_s == 6


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PREWARM_GATEWAY_PORT": "eighty"}, "PREWARM_GATEWAY_PORT"),
        ({"PREWARM_GATEWAY_WARM_THRESHOLD": "1.5"}, "PREWARM_GATEWAY_WARM_THRESHOLD"),
        ({"PREWARM_REDIS_URL": "http://localhost:6379"}, "PREWARM_REDIS_URL"),
        ({"PREWARM_REGISTRY_HEARTBEAT_TTL_S": "1"}, "PREWARM_REGISTRY_HEARTBEAT_TTL_S"),
        ({"PREWARM_GATEWAY_PROT": "1"}, "did you mean PREWARM_GATEWAY_PORT"),
    ],
)
def test_invalid_setting_names_the_variable(clean_env: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(SettingsError, match=message):
        Settings.load()


def test_bad_files(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        Settings.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[gateway\nport=1")
    with pytest.raises(SettingsError, match="not valid"):
        Settings.load(bad)
    unknown = tmp_path / "u.toml"
    unknown.write_text("[gatewya]\nport = 1\n")
    with pytest.raises(SettingsError, match="unknown settings group"):
        Settings.load(unknown)


def test_warmup_secret_required_when_used(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="PREWARM_WARMUP_SECRET"):
        Settings.load().warmup.require_secret()


def test_broker_url_carries_password_db_and_tls(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PREWARM_REDIS_URL", "rediss://cache.example:6380/0")
    clean_env.setenv("PREWARM_REDIS_PASSWORD", "s3cret")
    clean_env.setenv("PREWARM_REDIS_BROKER_DB", "3")
    url = broker_url(Settings.load().redis)
    assert url.startswith("rediss://:s3cret@cache.example:6380/3?") and "ssl_cert_reqs=required" in url


def test_cli_reports_bad_setting_with_exit_2(clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from prewarm.cli import main

    clean_env.setenv("PREWARM_GATEWAY_PORT", "-1")
    assert main(["settings"]) == 2
    assert "PREWARM_GATEWAY_PORT" in capsys.readouterr().err
