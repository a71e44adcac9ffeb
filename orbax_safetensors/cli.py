"""The ``orbax-safetensors`` command line.

Example::

    orbax-safetensors demo /tmp/demo
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from orbax_safetensors import _demo

    return _demo.main(args.dir, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="orbax-safetensors",
        description="Inspect, verify and convert safetensors checkpoints of JAX pytrees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small NNX model, checkpoint it, crash, resume",
        description="Trains a small NNX model on synthetic data, checkpoints it asynchronously "
        "through Orbax's CheckpointManager as safetensors, simulates a crash and resumes.",
    )
    demo.add_argument("dir", nargs="?", default=None, help="checkpoint directory (default: a new temp dir)")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
