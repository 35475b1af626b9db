"""`svrmad` console script: one subcommand per job, each owned by the module that does the work.

Each module named here exposes `add_arguments(parser)` and `main(args) -> int`, so the CLI stays a
table of contents and the modules stay importable without argparse. Only the chosen subcommand's
module is imported (`svrmad report` does not pay for torch).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from svrmad_local.errors import UserError

SUBCOMMANDS = {
    "run": ("svrmad_local.job.run", "run SVR-MAD (and other methods) over a dataset on a local model"),
    "replay": ("svrmad_local.analysis.replay", "re-run a method's controller against a recorded trace, no model"),
    "report": ("svrmad_local.analysis.report", "rebuild tables and figures of a run folder, no model"),
    "signals": ("svrmad_local.analysis.signals_page", "study the prior signals of run folders (AUROC, calibration, "
                "filtered voting, correlations), no model"),
    "merge": ("svrmad_local.job.merge", "join the folders of one run split with --shard into one, no model"),
    "prepare": ("svrmad_local.models.default", "fetch and convert the embedded default model"),
    "plan": ("svrmad_local.models.plan", "what a checkpoint needs on given GPUs, from its config and headers, no model"),
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
    """Errors that are the user's to fix (UserError, ValueError, OSError) print one line and exit 2;
    Ctrl-C exits 130. SVRMAD_DEBUG=1 shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in SUBCOMMANDS else None).parse_args(argv)
    plain, warnings.formatwarning = warnings.formatwarning, (
        lambda message, category, *rest: f"svrmad {args.command}: warning: {message}\n")
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        if os.environ.get("SVRMAD_DEBUG"):
            raise
        print(f"\nsvrmad {args.command}: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError) as exc:
        if os.environ.get("SVRMAD_DEBUG"):
            raise
        print(f"svrmad {args.command}: {one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = plain


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return text


if __name__ == "__main__":
    sys.exit(main())
