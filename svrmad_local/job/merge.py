"""`svrmad merge DIRS... --out DIR`: join the folders of one run split by `--shard K/N` (replicas
started by a scheduler without torch.distributed, e.g. a SLURM array) into one run folder.

The folders must share their settings fingerprint. Questions are taken once each under the commit
rule (analysis/folder.py), so merging again, or after new shards finish, adds only what is new. SID-ET's
rows are not taken: each shard tuned its skip rate on its own questions, and the merged folder
tunes it once on all of them (with the ablation sweeps, analysis/posthoc.py). The sources' token
statistics (`--save-token-stats`) that belong to their runs come along with their questions.
Sources are only read, under a shared lock (they may be read-only); a merge refused before it
writes leaves no --out behind.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from svrmad_local.analysis import token_files
from svrmad_local.analysis.folder import LOCK, RUN_JSON, RunFolder, note
from svrmad_local.analysis.posthoc import POST_HOC, finalize
from svrmad_local.analysis.run_config import RunConfig, diff_fingerprints


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run folders of the same run (e.g. its shards)")
    p.add_argument("--out", required=True, type=Path, help="the merged run folder (created, or extended)")


def main(args) -> int:
    sources = [RunFolder(d, create=False) for d in dict.fromkeys(args.dirs) if d.resolve() != args.out.resolve()]
    if not sources:
        raise ValueError(f"nothing to merge: every DIR given is --out {args.out} itself")
    for src in sources:  # checked before --out is created: a refused merge leaves nothing behind
        if not src.run_json.is_file():
            raise ValueError(f"{src.out} is not a run folder (no {RUN_JSON})")
        src.read_meta()  # a damaged run.json: one line, now (read again under the lock)
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")
    held: list[RunFolder] = []
    created = not args.out.exists()
    try:
        for src in sources:  # a folder whose run is still going is not merged half-way; sources are only read
            src.lock(shared=True)
            held.append(src)
        out = RunFolder(args.out)
        out.lock()
        held.append(out)
        _merge(sources, out)
    except BaseException:
        if created and args.out.is_dir() and {p.name for p in args.out.iterdir()} <= {LOCK}:
            shutil.rmtree(args.out)  # refused before writing: no folder holding only its lock file
        raise
    finally:
        for folder in held:
            folder.unlock()
    return 0


def _merge(sources: list[RunFolder], out: RunFolder) -> None:
    metas = [src.read_meta() for src in sources]
    own = out.read_meta()
    named = [(src.out, m) for src, m in zip(sources, metas)] + [(out.out, own)] * bool(own)
    for d, m in named:
        if "fingerprint" not in m or "config" not in m:
            raise ValueError(f"{d / RUN_JSON} records no settings (an older run): cannot check it matches the others")
        diff = diff_fingerprints(named[0][1]["fingerprint"], m["fingerprint"])
        if diff:
            raise ValueError(f"{d} was run with other settings than {named[0][0]} ({'; '.join(diff)}); "
                             "only folders of one run can be merged")
    first = named[0][1]
    cfg = RunConfig.from_dict(first["config"], where=named[0][0] / RUN_JSON)  # before anything is written
    out.cut_torn_tails()
    out.merge_parts()
    for src in sources:
        taken = [out.merge_from(p, drop_methods=POST_HOC) for p in (src.out, *src.part_dirs())]
        note(f"{src.out}: took {sum(t['trace.jsonl'] + t['skipped.jsonl'] for t in taken)} questions")
    cfg.shard, cfg.out = None, str(out.out)
    own.update(config=cfg.to_dict(), fingerprint=first["fingerprint"], paper_settings=cfg.paper_settings,
               merged_from=sorted({*own.get("merged_from", []), *(str(s.out) for s in sources)}))
    out.write_meta(own)
    for src in sources:  # after the trace lines: a file is taken for a question the merged folder holds
        copied, left = token_files.merge(src.out, out.out)
        if copied:
            note(f"{src.out}: took {copied} token-stats files")
        for line in left:
            note(f"left out {line}")
    finalize(out, cfg)
    from svrmad_local.job.run import print_summary, tally

    totals, rows, failed = tally(out)
    meta = out.read_meta()
    meta["totals"] = totals
    out.write_meta(meta)
    print_summary(out, totals, rows, failed, None, {})
