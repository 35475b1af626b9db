"""`svrmad` console script: one subcommand per job, each owned by the module that does the work.

Each module named here exposes `add_arguments(parser)` and `main(args) -> int`, so the CLI stays a
table of contents and the modules stay importable without argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "run": ("svrmad_local.eval.run", "run SVR-MAD (and other methods) over a dataset on a local model"),
    "replay": ("svrmad_local.eval.replay", "re-run a method's controller against a recorded trace, no model"),
    "report": ("svrmad_local.eval.report", "rebuild tables and figures of a run folder, no model"),
    "prepare": ("svrmad_local.models.default", "fetch and convert the embedded default model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svrmad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
