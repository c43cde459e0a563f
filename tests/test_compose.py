"""docker-compose.yml, validated without a Docker engine (none runs here): Debian's
`docker-compose config` accepts it, every `prewarm` command it runs parses with the CLI as
it is, every PREWARM_* variable exists in the settings and builds valid settings, and the
ports agree between the services, the settings and Prometheus' scrape targets."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prewarm.core.settings import MetricsSettings, Settings
from tests.test_helm import cli_refuses, known_env_vars

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKER_COMPOSE = shutil.which("docker-compose")


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The file as docker-compose resolves it (anchors merged, variables substituted)."""
    if DOCKER_COMPOSE is None:
        pytest.skip("docker-compose (Debian package) is not installed")
    out = subprocess.run(
        [DOCKER_COMPOSE, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def prewarm_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in config["services"].items() if svc.get("image") == "prewarm:local"}


def arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_file_is_valid(config: dict[str, Any]) -> None:
    assert set(config["services"]) >= {
        "redis", "agent-1", "agent-2", "planner", "beat", "gateway", "flower", "prometheus", "grafana",
    }


def test_redis_persists_to_a_volume(config: dict[str, Any]) -> None:
    """Issue 13: forecast history and planner state survive `docker compose restart redis`."""
    redis_svc = config["services"]["redis"]
    command = redis_svc["command"]
    assert arg(command, "--appendonly") == "yes" and arg(command, "--dir") == "/data"
    mounts = [(v["source"], v["target"]) if isinstance(v, dict) else tuple(v.split(":")[:2]) for v in redis_svc["volumes"]]
    assert ("redis-data", "/data") in mounts, mounts
    assert "redis-data" in config["volumes"]


def test_every_command_is_a_prewarm_subcommand(config: dict[str, Any]) -> None:
    services = prewarm_services(config)
    assert len(services) >= 7
    problems = {name: cli_refuses(svc["command"]) for name, svc in services.items()}
    assert {k: v for k, v in problems.items() if v} == {}
    assert [n for n, s in services.items() if s["command"][0] == "beat"] == ["beat"]  # exactly one beat
    agents = {arg(s["command"], "--node") for s in services.values() if s["command"][0] == "agent"}
    assert agents == {"node-1", "node-2"}  # two agents standing for two nodes


def test_every_variable_exists_and_builds_valid_settings(config: dict[str, Any], clean_env: pytest.MonkeyPatch) -> None:
    known = known_env_vars()
    for name, svc in prewarm_services(config).items():
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        unknown = {k for k in env if k.startswith("PREWARM_")} - known
        assert not unknown, f"{name}: variables not in prewarm.core.settings: {sorted(unknown)}"
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            Settings.load()  # raises SettingsError naming a bad value


def test_ports_agree_with_settings_and_prometheus(config: dict[str, Any], clean_env: pytest.MonkeyPatch) -> None:
    services = config["services"]
    gateway = services["gateway"]
    gw_port = int(arg(gateway["command"], "--port"))
    assert gw_port == Settings.load().gateway.port  # the documented default, 8080
    assert any(int(p["target"]) == gw_port for p in gateway["ports"])
    flower = services["flower"]
    ports = [p if isinstance(p, dict) else dict(zip(("host_ip", "published", "target"), p.split("/")[0].split(":")))
             for p in flower["ports"]]
    assert any(int(p["target"]) == int(arg(flower["command"], "--port")) for p in ports)
    # issue 13: Flower is behind basic auth and published on this host only
    assert all(p.get("host_ip") == "127.0.0.1" for p in ports), flower["ports"]
    assert ":" in flower["environment"]["FLOWER_BASIC_AUTH"]
    metrics_default = MetricsSettings().port
    targets: set[str] = set()
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        for static in job["static_configs"]:
            targets.update(static["targets"])
    assert f"gateway:{gw_port}" in targets
    for name, svc in prewarm_services(config).items():
        if svc["command"][0] in ("agent", "planner"):
            port = int(arg(svc["command"], "--metrics-port"))
            assert port == metrics_default
            assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}"
    for target in targets:
        assert target.split(":")[0] in services or target.startswith("localhost:"), target


def test_model_and_monitoring_files_line_up(config: dict[str, Any]) -> None:
    services = config["services"]
    make = services["make-model"]["command"]
    assert make[0] == "make-model"
    env = services["agent-1"]["environment"]
    model, revision = json.loads(env["PREWARM_PLANNER_MODELS"])[0].split("@")
    assert arg(make, "--out") == f"{env['PREWARM_RUNTIME_MODELS_DIR']}/{model}/{revision}"
    assert (arg(make, "--name"), arg(make, "--revision")) == (model, revision)
    assert services["agent-1"]["depends_on"]["make-model"]["condition"] == "service_completed_successfully"
    for name in ("prometheus", "grafana"):
        for source, _ in map(mount, services[name]["volumes"]):
            assert Path(source).exists(), f"{name} mounts {source}, which is not in the repository"
    mounts = dict(map(mount, services["prometheus"]["volumes"]))
    assert mounts[str(ROOT / "deploy" / "prometheus" / "rules.yml")] == "/etc/prometheus/rules.yml"


def mount(volume: str | dict[str, Any]) -> tuple[str, str]:
    """(source, target) of a volume in either compose syntax (short string or long mapping)."""
    if isinstance(volume, dict):
        return str(volume["source"]), str(volume["target"])
    source, target = volume.split(":")[:2]
    return source, target


def test_dockerfile_runs_prewarm() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["prewarm"]' in text
    for package in ("prewarm", "workers", "forecasting"):
        assert f"COPY {package} ./{package}" in text
