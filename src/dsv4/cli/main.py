"""Entry point of the `dsv4` console script."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dsv4.cli import generate, init, rl, serve, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4",
                                     description="Serve and RL-train DeepSeek-V4-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    init.add_parser(sub)
    generate.add_parser(sub)
    serve.add_parser(sub)
    train.add_parser(sub)
    rl.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
