"""Settings: environment over file over defaults; bad values and unknown names fail naming the setting."""

from __future__ import annotations

import os
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


def test_a_redis_password_with_url_characters_survives_the_broker_url(clean_env: pytest.MonkeyPatch) -> None:
    """Issue 13 (minor): a password holding '/' or '#' broke the Celery broker URL."""
    from kombu.utils.url import url_to_parts

    password = "p/a#ss@w%rd?"
    clean_env.setenv("PREWARM_REDIS_URL", "redis://cache.example:6379/0")
    clean_env.setenv("PREWARM_REDIS_PASSWORD", password)
    parts = url_to_parts(broker_url(Settings.load().redis))
    assert parts.password == password and parts.hostname == "cache.example" and parts.port == 6379


@pytest.mark.parametrize(("name", "value", "says"), [
    ("PREWARM_WARMUP_SECRET", "", "must not be empty"),
    ("PREWARM_GATEWAY_UPSTREAM_TIMEOUT_S", "inf", "finite"),
    ("PREWARM_REGISTRY_HEARTBEAT_TTL_S", "nan", "finite"),
    ("PREWARM_PLANNER_BATCH_JOBS", "not json", "takes JSON"),
])
def test_bad_settings_are_one_clear_line(clean_env: pytest.MonkeyPatch, name: str, value: str, says: str) -> None:
    """Issue 13 (minor): these were accepted, or a 40-line traceback."""
    from prewarm.core.errors import SettingsError

    clean_env.setenv(name, value)
    with pytest.raises(SettingsError, match=says):
        Settings.load()


def test_planner_models_take_json_or_a_comma_separated_list(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PREWARM_PLANNER_MODELS", "tiny@r1")
    assert Settings.load().planner.models == ["tiny@r1"]
    clean_env.setenv("PREWARM_PLANNER_MODELS", "a@r1, b@r2")
    assert Settings.load().planner.models == ["a@r1", "b@r2"]
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["a@r1"]')
    assert Settings.load().planner.models == ["a@r1"]


@pytest.mark.parametrize("command", ["agent", "beat"])
def test_unreachable_redis_at_start_is_one_line_not_a_traceback(command: str, tmp_path: Path) -> None:
    """Issue 13 (minor): the agent and the beat used to exit with 60-70-line tracebacks."""
    import subprocess
    import sys

    from prewarm.registry.embedded import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env.update({"PREWARM_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "PREWARM_WARMUP_SECRET": "x",
                "PREWARM_AGENT_STATE_DIR": str(tmp_path), "PREWARM_METRICS_PORT": "0"})
    out = subprocess.run([sys.executable, "-m", "prewarm.cli", command], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "Redis is unreachable" in out.stderr, out.stderr[-2000:]


def test_flower_beyond_this_host_needs_basic_auth(clean_env: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13 (minor): `prewarm flower --address 0.0.0.0` served an open UI that can revoke tasks."""
    from prewarm.cli import main

    clean_env.setenv("PREWARM_REDIS_URL", "redis://127.0.0.1:1/0")
    clean_env.delenv("FLOWER_BASIC_AUTH", raising=False)
    assert main(["flower", "--address", "0.0.0.0"]) == 2
    assert "FLOWER_BASIC_AUTH" in capsys.readouterr().err


def test_worker_metrics_bind_loopback_unless_told(clean_env: pytest.MonkeyPatch) -> None:
    """Issue 13 (minor): agent and planner /metrics bound 0.0.0.0 unconditionally."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from prewarm.core.metrics import Metrics
    from prewarm.registry.embedded import free_port
    from workers.process import serve_metrics

    for env, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        if env:
            clean_env.setenv("PREWARM_METRICS_HOST", env)
        ctx = SimpleNamespace(settings=Settings.load(), metrics=Metrics(CollectorRegistry()))
        served = serve_metrics(ctx, free_port())  # type: ignore[arg-type]
        server = served[0] if isinstance(served, tuple) else served
        try:
            assert server.server_address[0] == expected
        finally:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize(("value", "says"), [
    ("not json", "must be model@revision"),
    ("bad name!@r1", "model must be"),
    ('["a@r1", "b"]', "must be model@revision"),
    ("a@bad rev", "revision must be"),
])
def test_planner_models_are_validated_names(clean_env: pytest.MonkeyPatch, value: str, says: str) -> None:
    """Issue 20 (minor): 'not json' was accepted as a model named 'not json', and a gateway served
    a model named 'bad name!'."""
    clean_env.setenv("PREWARM_PLANNER_MODELS", value)
    with pytest.raises(SettingsError, match=f"PREWARM_PLANNER_MODELS.*{says}"):
        Settings.load()


def test_plan_dry_run_with_bad_planner_models_is_one_line(clean_env: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20 (minor): `prewarm plan --dry-run` died with a traceback."""
    from prewarm.cli import main

    clean_env.setenv("PREWARM_PLANNER_MODELS", "not json")
    clean_env.setenv("PREWARM_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["plan", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "PREWARM_PLANNER_MODELS" in err and "Traceback" not in err


@pytest.mark.parametrize(("env", "says"), [
    ({"PREWARM_REDIS_URL": "redis://127.0.0.1:6379/zero"}, "database index must be a non-negative integer"),
    ({"PREWARM_REDIS_URL": "redis://127.0.0.1:6379/99999999999"}, "out of range"),
    ({"PREWARM_REDIS_URL": "redis://127.0.0.1:99999/0"}, "PREWARM_REDIS_URL"),
    ({"PREWARM_REDIS_URL": "sentinel://h1:26379/0"}, "PREWARM_REDIS_SENTINEL_MASTER.*required"),
    ({"PREWARM_REDIS_URL": "sentinel://h1,h2:26379/0", "PREWARM_REDIS_SENTINEL_MASTER": "m"}, "host:port"),
])
def test_redis_urls_are_checked_when_read(clean_env: pytest.MonkeyPatch, env: dict[str, str], says: str) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(SettingsError, match=says):
        Settings.load()


def test_a_sentinel_url_gives_kombus_sentinel_broker_and_master_name(clean_env: pytest.MonkeyPatch) -> None:
    from kombu.utils.url import url_to_parts

    from prewarm.registry.connection import broker_transport_options

    clean_env.setenv("PREWARM_REDIS_URL", "sentinel://:p%2Fw@s1:26379,s2:26380/2")
    clean_env.setenv("PREWARM_REDIS_SENTINEL_MASTER", "prewarm")
    clean_env.setenv("PREWARM_REDIS_SENTINEL_PASSWORD", "sentinel-pw")
    cfg = Settings.load().redis
    url = broker_url(cfg)
    first, second = url.split(";")
    assert url_to_parts(first).scheme == "sentinel" and url_to_parts(first).password == "p/w"
    assert (url_to_parts(second).hostname, url_to_parts(second).port) == ("s2", 26380) and first.endswith("/2")
    opts = broker_transport_options(cfg)
    assert opts["master_name"] == "prewarm" and opts["sentinel_kwargs"]["password"] == "sentinel-pw"
