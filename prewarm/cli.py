"""The `prewarm` command: wires the stages together; imported by nothing.

Each subcommand is a `_cmd_<name>(args, settings)` function registered in `_build_parser`.
Settings are loaded once (environment, then `--config`), and a bad setting ends the
command with exit code 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

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

    return parser


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
