"""The `prewarm` command: wires the stages together; imported by nothing.

Each subcommand is a `_cmd_<name>(args, settings)` function registered in `_build_parser`.
Settings are loaded once (environment, then `--config`), and a bad setting ends the
command with exit code 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Iterator

from prewarm.errors import SettingsError
from prewarm.settings import Settings

Handler = Callable[[argparse.Namespace, Settings], int]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prewarm", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", help="settings file (TOML or YAML); PREWARM_* variables override it")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Each block: one subcommand. Keep them in the order a user meets them.
    p = sub.add_parser("settings", help="print the effective settings (secrets masked)")
    p.set_defaults(handler=_cmd_settings)

    p = sub.add_parser("gateway", help="run the HTTP gateway (embedded Redis when PREWARM_REDIS_URL is unset)")
    p.add_argument("--host", help="listen address (default: gateway.host)")
    p.add_argument("--port", type=int, help="listen port (default: gateway.port)")
    p.set_defaults(handler=_cmd_gateway)

    return parser


@contextlib.contextmanager
def _redis_for(settings: Settings) -> Iterator[str]:
    """Yield the Redis URL to use: PREWARM_REDIS_URL, or an embedded server started and stopped here.

    The embedded server's URL is exported as PREWARM_REDIS_URL so child processes share it.
    """
    if settings.redis.url:
        yield settings.redis.url
        return
    from prewarm.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        settings.redis.url = server.url
        os.environ["PREWARM_REDIS_URL"] = server.url
        print(f"prewarm: PREWARM_REDIS_URL is unset; started an embedded Redis at {server.url}", flush=True)
        try:
            yield server.url
        finally:
            os.environ.pop("PREWARM_REDIS_URL", None)
            print("prewarm: embedded Redis stopped", flush=True)


def _cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    from prewarm import gateway

    with _redis_for(settings):
        gateway.run(settings, host=args.host, port=args.port)
    return 0


def _cmd_settings(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from prewarm.settings import _GROUPS

    out = {name: getattr(settings, name).model_dump(mode="json") for name in _GROUPS}
    print(json.dumps(out, indent=2, default=str))
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


if __name__ == "__main__":
    sys.exit(main())
