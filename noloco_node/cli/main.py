"""`noloco-node` entry point: subcommands, logging, and error-to-exit-code mapping.

Exit codes: 0 success, 2 a bad config or flag (the message names the field and the fix),
3 the DHT could not be joined through the initial peers, 4 peers cannot reach the address this
node announces, 10-19 `doctor` checks (see `noloco-node doctor --help`), 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys

from noloco_node import __version__
from noloco_node.cli import (
    bootstrap,
    config_cmd,
    demo,
    doctor,
    experiment,
    health,
    join,
    keygen,
    model_cmds,
    plan,
    status,
)
from noloco_node.config import ConfigError
from noloco_node.errors import BootstrapError, DataError, IdentityError, NodeError, UnreachableAddress

COMMANDS = (join, bootstrap, status, doctor, health, keygen, demo, experiment, config_cmd, model_cmds, plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="noloco-node",
        description="A NoLoCo peer node: pipeline stages with random routing and pairwise outer steps, no all-reduce.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"noloco-node {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    for sub in _subparsers(parser):
        sub.allow_abbrev = False  # `demo --replica 3` is a typo, not --replicas
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += [sub, *_subparsers(sub)]
    return out


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """As parse_args, but an unknown flag is reported by the subcommand that got it, with its usage
    (argparse leaves them to the top-level parser, whose usage lists commands, not flags)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser_of = getattr(args, "parser_of", None) or parser
        parser_of.error(f"unrecognized arguments: {' '.join(unknown)}{_fix_for(parser_of, unknown)}")
    return args


def _fix_for(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """'; did you mean --stage?' for the first misspelt flag, else where the flags are listed."""
    import difflib

    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for arg in unknown:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return f"; `{parser.prog} --help` lists its flags"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    for sub in _subparsers(parser):
        sub.set_defaults(parser_of=sub)
    args = parse_args(parser, argv)
    from noloco_node.runtime.logging import quiet_native_logs, setup_logging

    setup_logging(args.log_level)
    quiet_native_logs(args.log_level)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # `status --json | head`: the reader has what it wanted. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ConfigError, DataError, IdentityError) as exc:  # a bad value, data, tokenizer or identity file
        print(f"noloco-node: {exc}", file=sys.stderr)
        return 2
    except NodeError as exc:
        print(f"noloco-node: {exc.explain()}", file=sys.stderr)
        return 3 if isinstance(exc, BootstrapError) else 4 if isinstance(exc, UnreachableAddress) else 1
    except KeyboardInterrupt:
        print("noloco-node: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
