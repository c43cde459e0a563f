"""The `prewarm` command: wires the stages together; imported by nothing.

`prewarm backtest` (trace replay, sweeps, the fleet backtest) is in `prewarm.cli.backtest`.

Each subcommand is a `_cmd_<name>(args, settings)` function registered in `_build_parser`.
Settings are loaded once (environment, then `--config`), and a bad setting ends the
command with exit code 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Callable, Iterator

from prewarm.core.errors import SettingsError
from prewarm.core.settings import Settings
from prewarm.cli import backtest, rollout

Handler = Callable[[argparse.Namespace, Settings], int]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prewarm", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", help="settings file (TOML or YAML); PREWARM_* variables override it")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Each block: one subcommand. Keep them in the order a user meets them.
    p = sub.add_parser("settings", help="print the effective settings (secrets masked)")
    p.set_defaults(handler=_cmd_settings)

    p = sub.add_parser("up", help="run the whole system locally on a traffic replay (the main job)")
    p.add_argument("--trace", help="replay this trace (any format the history loaders read); default: a synthetic workload")
    p.add_argument("--duration", type=float, default=360.0, help="a trace is compressed into this many seconds")
    p.add_argument("--max-rps", type=float, default=6.0, help="a trace's mean rate is thinned to this")
    p.add_argument("--days", type=int, default=3, help="synthetic workload: compressed days")
    p.add_argument("--day-seconds", type=float, default=120.0, help="synthetic workload: length of one day")
    p.add_argument("--model-size", default="tiny", help="size of the local demo model (see make-model)")
    p.add_argument("--out", default=".prewarm/up", help="where logs, plots and the report go")
    p.add_argument("--no-flower", action="store_true", help="do not start Flower")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--history", type=float, default=0.0, dest="history_s",
                   help="with --trace: count the trace's first SECONDS into the gateway's counters as history (the "
                        "planner starts with its daily profile), then replay the next --duration seconds uncompressed")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: the agents serve the model with a real vLLM (the .venv-vllm environment, "
                        "`make vllm-env`) instead of prewarm's runtime")
    p.add_argument("--models", type=int, default=1,
                   help="N > 1: N models of different sizes (one dense, the others sparse) under a GPU budget "
                        "that cannot hold them all, planned as a fleet")
    p.add_argument("--rollout", choices=["good", "corrupt"], help="midway, roll out a second revision of the model "
                   "(corrupt: its weights damaged on disk, which must roll back with no user-visible error)")
    p.set_defaults(handler=_cmd_up)

    p = sub.add_parser("gateway", help="run the HTTP gateway (embedded Redis when PREWARM_REDIS_URL is unset)")
    p.add_argument("--host", help="listen address (default: gateway.host)")
    p.add_argument("--port", type=int, help="listen port (default: gateway.port)")
    p.set_defaults(handler=_cmd_gateway)

    p = sub.add_parser("k8s", help="act on Kubernetes: scale a Deployment, raise/restore an HPA floor, list GPU nodes")
    p.add_argument("--namespace", help="namespace (default: kubernetes.namespace)")
    p.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster, then ~/.kube/config)")
    k8s_sub = p.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    q = k8s_sub.add_parser("scale", help="set a Deployment's replicas through its scale subresource")
    q.add_argument("--deployment", required=True)
    q.add_argument("--replicas", type=int, required=True)
    q.add_argument("--dry-run", action="store_true", help="print the patch and change nothing")
    q = k8s_sub.add_parser("min-replicas", help="raise an HPA's minReplicas, remembering the original")
    q.add_argument("--hpa", required=True)
    q.add_argument("--min", type=int, required=True, dest="min_replicas")
    q.add_argument("--dry-run", action="store_true", help="print the patch and change nothing")
    q = k8s_sub.add_parser("restore", help="restore an HPA's original minReplicas")
    q.add_argument("--hpa", required=True)
    q.add_argument("--dry-run", action="store_true", help="print the patch and change nothing")
    q = k8s_sub.add_parser("nodes", help="list the GPU nodes (label gpu.feature/preload=true) as node views")
    q = k8s_sub.add_parser("watch", help="print each pod of a Deployment as it becomes Ready (JSON lines)")
    q.add_argument("--deployment", required=True)
    q.add_argument("--count", type=int, help="stop after this many Ready pods")
    q = k8s_sub.add_parser("prewarm-pods", help="warm, validate and register each Ready pod of an inference "
                           "Deployment (vLLM, TGI, any OpenAI-compatible server) in the replica registry")
    q.add_argument("--deployment", required=True)
    q.add_argument("--model", required=True, help="model name in the registry (what gateway clients ask for)")
    q.add_argument("--revision", required=True)
    q.add_argument("--served-model", help="the name the pods' server knows the model by (default: --model)")
    q.add_argument("--pool", choices=["serving", "warm"], default="serving")
    q.add_argument("--node-class", help="node class of the latency baseline (default: agent.node_class)")
    q.add_argument("--count", type=int, help="stop after this many Ready pods were handled")
    q.add_argument("--metrics-port", type=int, help="serve /metrics on this port (default: none)")
    p.set_defaults(handler=_cmd_k8s)

    p = sub.add_parser("keda-scaler", help="serve the planner's replica targets to KEDA (external scaler, gRPC) "
                       "and as the gauge prewarm_planner_target_replicas")
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=9090, help="gRPC port of the external scaler")
    p.add_argument("--metrics-port", type=int, help="serve /metrics (the target gauge) on this port (default: none)")
    p.add_argument("--max-age", type=float, dest="max_age_s",
                   help="refuse targets older than this many seconds (default: the planning round's lock, "
                        "3 x planner.interval_s and at least 30 s: no planner has planned since)")
    p.set_defaults(handler=_cmd_keda_scaler)

    p = sub.add_parser("serve-model", help="run the model host: OpenAI-compatible completions, load/sleep/wake control")
    p.add_argument("--model-dir", required=True, help="directory with config.json, model.safetensors, manifest.json")
    p.add_argument("--host", help="listen address (default: runtime.host)")
    p.add_argument("--port", type=int, help="listen port, 0 for any free one (default: runtime.port)")
    p.add_argument("--model-name", help="served model name (default: the manifest's)")
    p.add_argument("--revision", help="served revision (default: the manifest's)")
    p.add_argument("--node", default="", help="node label of the loading metrics (default: none)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: runtime.device")
    p.add_argument("--no-autoload", action="store_true", help="wait for POST /load instead of loading at start")
    p.add_argument("--self-validate", action="store_true",
                   help="once loaded, run the three validation checks in-process and turn /readyz 200 if they pass "
                        "(a host with no agent, such as a Kubernetes pod)")
    p.set_defaults(handler=_cmd_serve_model)

    p = sub.add_parser("make-model", help="write a random-weight model (config, safetensors, manifest); nothing is downloaded")
    p.add_argument("--size", required=True, help="tiny (~4 MB), small (~54 MB), or a size such as 512MB, 1GB, 2GB")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--name", help="model name in the manifest (default: derived from the dimensions)")
    p.add_argument("--revision", help="revision in the manifest (default: the first 12 hex digits of its checksum)")
    p.set_defaults(handler=_cmd_make_model)

    p = sub.add_parser("agent", help="run a node agent: the Celery worker of prewarm.node.<node> that prewarms replicas")
    p.add_argument("--node", help="node name (default: agent.node; in Kubernetes spec.nodeName via the downward API)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics, 0 for none (default: metrics.port)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(handler=_cmd_agent)

    p = sub.add_parser("planner", help="run the planner worker (queue prewarm.planner): reaping, scale from zero")
    p.add_argument("--metrics-port", type=int, help="port of /metrics, 0 for none (default: metrics.port)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(handler=_cmd_planner)

    p = sub.add_parser("plan", help="run the planner once against the shared Redis and print each model's scale events")
    p.add_argument("--dry-run", action="store_true",
                   help="forecast-only: print the events the planner would emit now, per model, and change nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object per model")
    p.set_defaults(handler=_cmd_plan)

    p = sub.add_parser("beat", help="run the one Celery beat (a second one waits as a standby)")
    p.add_argument("--schedule-file", help="beat state file (default: <agent.state_dir>/beat-schedule)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(handler=_cmd_beat)

    p = sub.add_parser("flower", help="run Celery Flower for the prewarm app (task and worker monitoring)")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(handler=_cmd_flower)

    backtest.add_parser(sub)
    rollout.add_parser(sub)

    return parser


@contextlib.contextmanager
def _redis_for(settings: Settings) -> Iterator[str]:
    """Yield the Redis URL to use: PREWARM_REDIS_URL, or an embedded server started and stopped here.

    The embedded server's URL is exported as PREWARM_REDIS_URL so child processes share it.
    """
    if settings.redis.url:
        yield settings.redis.url
        return
    from prewarm.registry.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        settings.redis.url = server.url
        os.environ["PREWARM_REDIS_URL"] = server.url
        print(f"prewarm: PREWARM_REDIS_URL is unset; started an embedded Redis at {server.url}", flush=True)
        try:
            yield server.url
        finally:
            os.environ.pop("PREWARM_REDIS_URL", None)
            print("prewarm: embedded Redis stopped", flush=True)


def _cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    import faulthandler
    import signal
    from pathlib import Path

    from workers.up import run as up

    # `kill -USR1` prints every thread's stack to stderr: what a run that does not stop is waiting on
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    opts = up.UpOptions(
        out_dir=Path(args.out), trace=args.trace, duration_s=args.duration, max_rps=args.max_rps, days=args.days,
        day_s=args.day_seconds, model_size=args.model_size, seed=args.seed, flower=not args.no_flower,
        history_s=args.history_s,
        rollout=args.rollout,
        engine=args.engine,
    )
    with _redis_for(settings):
        if args.models and args.models > 1:
            from workers.up import fleet

            if args.engine != "builtin":
                print("prewarm up: --models > 1 runs the built-in engine only", file=sys.stderr)
                return 2

            return fleet.run(settings, opts, args.models)
        return up.run(settings, opts)


def _cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    from prewarm.gateway import server as gateway

    with _redis_for(settings):
        gateway.run(settings, host=args.host, port=args.port)
    return 0


def _cmd_agent(args: argparse.Namespace, settings: Settings) -> int:
    from prewarm.core.domain import check_name
    from prewarm.core.errors import InvalidPayload
    from workers.node.agent import run_agent

    if args.node:
        try:
            settings.agent.node = check_name(args.node, "--node")
        except InvalidPayload as exc:
            raise SettingsError(str(exc)) from None
    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: an agent needs the shared Redis of its planner and gateway")
    return run_agent(settings, loglevel=args.loglevel, metrics_port=args.metrics_port)


def _cmd_planner(args: argparse.Namespace, settings: Settings) -> int:
    from workers.planning.worker import run_planner

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: the planner needs the shared Redis")
    return run_planner(settings, loglevel=args.loglevel, metrics_port=args.metrics_port)


def _cmd_plan(args: argparse.Namespace, settings: Settings) -> int:
    import json
    import time

    from prewarm.core.keys import PLAN_ROUND_LOCK
    from workers.context import WorkerContext
    from workers.planning.forecast import decide, forecast_and_plan

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: the planner reads the gateway's counters in the shared Redis")
    if args.dry_run:
        settings.planner.dry_run = True
    ctx = WorkerContext.build(settings)
    now = time.time()
    fleet = settings.planner.fleet_budget_gb > 0  # one fleet round over the pool, as the planner worker runs it
    if not args.dry_run:
        from workers.planning.round_lock import planning_round, ttl_s

        wait = ttl_s(settings.planner.interval_s)
        with planning_round(ctx.client, settings.planner.interval_s, wait_s=wait) as mine:
            if not mine:  # the planner worker's round runs in milliseconds to seconds: one held this long is stuck
                print(f"prewarm plan: another planning round has held its lock for over {wait:.0f} s "
                      f"({PLAN_ROUND_LOCK}); nothing done", file=sys.stderr)
                return 1
            now = time.time()  # after any wait for the lock
            if fleet:
                from workers.app import make_app
                from workers.planning.fleet import fleet_and_plan

                app = make_app(settings)
                try:
                    plans = fleet_and_plan(ctx, app, now=now)
                finally:
                    app.close()
            else:
                plans = forecast_and_plan(ctx, now=now)
        for m in plans:
            print(json.dumps({"model": m.model, "status": m.status, "mode": m.mode, "events": list(m.events),
                              "new_events": list(m.new_events), "dropped": m.dropped}))
        return 0
    if fleet:
        return _print_fleet_decision(ctx, now=now, as_json=args.json)
    for spec, inp, d in decide(ctx, now=now):
        fc = d.forecast
        if args.json:
            print(json.dumps({"model": spec.name, "revision": spec.revision, "mode": d.mode, "target": d.target,
                              "live": inp.replicas.live, "lead_s": d.lead_s, "forecast_error": fc.error,
                              "events": [e.to_payload() for e in d.events],
                              "dropped": [{"event": x.event.to_payload(), "reason": x.reason} for x in d.dropped]}))
            continue
        err = "-" if fc.error is None else f"{fc.error:.1%}"
        print(f"{spec.name}@{spec.revision}: {d.mode} mode (recent forecast error {err}), live {inp.replicas.live}, "
              f"target {d.target} (+{d.pool_target} warm), lead {d.lead_s:.1f} s — dry run, nothing done")
        for e in d.events or ():
            print(f"  would {e.kind.value} {e.replicas} ({e.pool.value}): {e.reason}")
        if not d.events:
            print("  no event")
        for x in d.dropped:
            print(f"  dropped {x.event.kind.value} {x.event.replicas}: {x.reason}")
    return 0


def _print_fleet_decision(ctx: Any, *, now: float, as_json: bool) -> int:
    """`prewarm plan --dry-run` with a fleet budget: the pool's round, read-only (every model's tier, nodes and
    the actions the agents would get), from the memory price the live round carries."""
    import json

    from forecasting.fleet.round import RoundState
    from workers.planning.fleet import fleet_decide

    decision, _ = fleet_decide(ctx, now=now, state=RoundState())
    if decision is None:
        return 0
    plan, view = decision.result.plan, decision.view()
    actions: dict[str, list[dict[str, str]]] = {m: [] for m in decision.names}
    for a in plan.actions:
        actions[a.model].append({"kind": a.kind.value, "node": a.node})
    budget = ctx.settings.planner.fleet_budget_gb
    if not as_json:
        print(f"fleet round: {plan.gpu_gb:.0f} GB on GPU within {budget:g} GB, memory price {plan.lam:.3g} (steered by "
              f"the {ctx.settings.planner.cold_start_budget:.2%} cold-start budget), {len(plan.asleep)} asleep — dry run, "
              "nothing done")
    for name in decision.names:
        v = {**view[name], "actions": actions[name]}
        if as_json:
            print(json.dumps({"model": name, "revision": decision.specs[name].revision, "fleet": True, **v}))
            continue
        where = f" on {', '.join(v['nodes'])}" if v["nodes"] else ""
        print(f"{name}@{decision.specs[name].revision}: {v['tier']}{where}, {v['replicas']} replica(s) on GPU, "
              f"density {v['density']:.3g}{' (dense)' if v['dense'] else ''}")
        for act in actions[name]:
            print(f"  would {act['kind']} on {act['node']}")
    return 0


def _cmd_keda_scaler(args: argparse.Namespace, settings: Settings) -> int:
    import logging
    import signal
    import threading

    from prewarm.gateway.keda import run
    from prewarm.registry.connection import sync_client

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: the scaler reads the planner's targets from the shared Redis")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from workers.planning.round_lock import ttl_s

    max_age = args.max_age_s if args.max_age_s is not None else ttl_s(settings.planner.interval_s)
    return run(sync_client(settings.redis), host=args.host, port=args.port, max_age_s=max_age,
               metrics_port=args.metrics_port, stop=stop, cfg=settings.keda,
               ready=lambda port: print(f"prewarm keda-scaler: listening on {args.host}:{port}", flush=True))


def _cmd_beat(args: argparse.Namespace, settings: Settings) -> int:
    from workers.process import setup_logging
    from workers.beat import run_beat

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: the beat needs the shared Redis")
    setup_logging(args.loglevel)
    return run_beat(settings, schedule_file=args.schedule_file, loglevel=args.loglevel)


def _cmd_flower(args: argparse.Namespace, settings: Settings) -> int:
    from workers.app import make_app

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: Flower watches the shared broker")
    argv = ["flower", f"--port={args.port}", f"--address={args.address}"]
    auth = os.environ.get("FLOWER_BASIC_AUTH", "").strip()
    if auth:
        argv.append(f"--basic_auth={auth}")
    elif args.address not in ("127.0.0.1", "localhost", "::1"):
        # Flower can revoke tasks and shut workers down: never open it beyond this host unauthenticated
        raise SettingsError(f"Flower on {args.address} needs FLOWER_BASIC_AUTH=user:password "
                            "(comma-separated for several users), or --address 127.0.0.1")
    app = make_app(settings)
    app.start(argv)
    return 0


def _cmd_serve_model(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio
    import logging

    from prewarm.runtime import serve as runtime

    if args.self_validate and args.no_autoload:
        print("prewarm serve-model: --self-validate needs the load to start by itself (drop --no-autoload)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.device:
        settings.runtime.device = args.device
    from prewarm.core.errors import PermanentError

    bind = args.host or settings.runtime.host
    try:
        host = runtime.build_host(args.model_dir, settings, model_name=args.model_name, revision=args.revision,
                                  node=args.node, bind=bind)
    except (PermanentError, ValueError) as exc:  # no model there, a bad manifest, a bad device, no token
        print(f"prewarm serve-model: {exc}", file=sys.stderr)
        return 2
    port = settings.runtime.port if args.port is None else args.port

    def announce(bound: int) -> None:
        print(f"prewarm: serving {host.model_name} on http://{bind}:{bound}", flush=True)

    asyncio.run(runtime.serve(host, bind, port, autoload=not args.no_autoload, self_validate=args.self_validate,
                              on_ready=announce))
    return 0


def _cmd_make_model(args: argparse.Namespace, settings: Settings) -> int:
    import json
    import time

    from prewarm.runtime.model import ModelError, load_manifest, make_model

    t = time.perf_counter()
    try:
        out = make_model(args.out, args.size, seed=args.seed, dtype=args.dtype, name=args.name, revision=args.revision)
    except ModelError as exc:
        print(f"prewarm make-model: {exc}", file=sys.stderr)
        return 2
    m = load_manifest(out)
    print(json.dumps({"dir": str(out), "name": m.name, "revision": m.revision, "dtype": m.dtype,
                      "tensors": len(m.tensors), "bytes": m.total_bytes, "checksum": m.checksum,
                      "seconds": round(time.perf_counter() - t, 3)}))
    return 0


def _cmd_settings(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from prewarm.core.settings import _GROUPS

    out = {name: getattr(settings, name).model_dump(mode="json") for name in _GROUPS}
    print(json.dumps(out, indent=2, default=str))
    return 0


def _cmd_k8s(args: argparse.Namespace, settings: Settings) -> int:
    import json
    from dataclasses import asdict

    from prewarm.core.errors import PrewarmError
    from prewarm.adapters.k8s import KubeActuator, PatchResult, api_client_from_settings

    kube = settings.kubernetes
    namespace = args.namespace or kube.namespace
    dry_run = bool(getattr(args, "dry_run", False) or kube.dry_run)
    try:
        api = api_client_from_settings(args.kubeconfig or kube.kubeconfig)
        actuator = KubeActuator(api, namespace)
        result: PatchResult | None = None
        if args.k8s_command == "scale":
            result = actuator.scale(args.deployment, args.replicas, dry_run=dry_run)
        elif args.k8s_command == "min-replicas":
            result = actuator.raise_min_replicas(args.hpa, args.min_replicas, dry_run=dry_run)
        elif args.k8s_command == "restore":
            result = actuator.restore_min_replicas(args.hpa, dry_run=dry_run)
        elif args.k8s_command == "nodes":
            for view in actuator.list_gpu_nodes(kube.node_selector):
                out = asdict(view)
                out["snapshots"] = sorted(view.snapshots)
                print(json.dumps(out, sort_keys=True))
        elif args.k8s_command == "watch":
            from prewarm.adapters.k8s_watch import PodWatcher

            watcher = PodWatcher(api, namespace, args.deployment, pod_port=kube.pod_port)
            watcher.run(lambda pod: print(json.dumps(asdict(pod), sort_keys=True), flush=True), max_ready=args.count)
        elif args.k8s_command == "prewarm-pods":
            from workers.pods import run_cli, target_from

            if not settings.redis.url:
                raise SettingsError("PREWARM_REDIS_URL is not set: prewarm-pods registers replicas in the shared Redis")
            target = target_from(settings, model=args.model, revision=args.revision, served_model=args.served_model,
                                 pool=args.pool, node_class=args.node_class)
            return run_cli(settings, api, namespace, args.deployment, target, count=args.count,
                           metrics_port=args.metrics_port)
        if result is not None:
            print(json.dumps(result.to_json(), sort_keys=True))
    except SettingsError:
        raise
    except PrewarmError as exc:
        print(f"prewarm k8s: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.load(args.config)
    except SettingsError as exc:
        print(f"prewarm: {exc}", file=sys.stderr)
        return 2
    handler: Handler = args.handler
    try:
        return handler(args, settings)
    except SettingsError as exc:
        print(f"prewarm: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _redis_unreachable(exc):
            raise
        print(f"prewarm {args.command}: Redis is unreachable ({exc}); check PREWARM_REDIS_URL and that Redis is up",
              file=sys.stderr)
        return 1


def _redis_unreachable(exc: BaseException) -> bool:
    """A Redis that cannot be reached at start is an operator's fix, not a 70-line traceback."""
    import redis

    from prewarm.core.errors import RegistryUnavailable

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RegistryUnavailable, redis.ConnectionError, redis.TimeoutError)):
            return True
        if type(exc).__module__.startswith("kombu") and "connect" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False

