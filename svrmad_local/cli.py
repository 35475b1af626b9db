"""`svrmad` console script: one subcommand per job, each owned by the module that does the work.

Each module named here exposes `add_arguments(parser)` and `main(args) -> int`, so the CLI stays a
table of contents and the modules stay importable without argparse. Only the chosen subcommand's
module is imported (`svrmad report` does not pay for torch).
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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with `only` set, one whose other subcommands have no options yet."""
    parser = argparse.ArgumentParser(prog="svrmad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in SUBCOMMANDS else None).parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
