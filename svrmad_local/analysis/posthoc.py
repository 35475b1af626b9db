"""What a run folder derives from its trace without a model, and when to derive it again.

- results rows a crash left out (the commit rule of analysis/folder.py): replayed from the trace;
- SID-ET, which needs every question's initial responses: its skip rate is tuned (Algorithm 2,
  against SVR-MAD) over the folder's whole trace, so a folder merged from shards or ranks is tuned
  once, on all of its questions;
- with --ablations, Appendix B's sweeps (ablations.jsonl).

run.json's "post_hoc" entry records which questions that was done over; `svrmad report` redoes it
when the folder's trace has changed since (e.g. folders joined by hand).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING

from svrmad_local.analysis.folder import FolderBusy, RunFolder, note
from svrmad_local.analysis.folder import rows as run_rows
from svrmad_local.debate.replay_backend import MissingDebate
from svrmad_local.debate.trace import read_trace, row_question

if TYPE_CHECKING:
    from svrmad_local.analysis.run_config import RunConfig

POST_HOC = {"sid-et"}  # needs every question's initial responses: runs from the trace afterwards


def live_methods(cfg: RunConfig) -> list[str]:
    return [m for m in cfg.methods if m not in POST_HOC]


def sid_et_tunes(cfg: RunConfig) -> bool:
    """True when SID-ET's skip rate is tuned against SVR-MAD (Algorithm 2): no --skip-rate, no --threshold."""
    return "sid-et" in cfg.methods and cfg.skip_rate is None and cfg.params_for("sid-et").get("threshold") is None


def recorded_methods(cfg: RunConfig) -> list[str]:
    """The methods a live question runs: the live ones, plus what the post-hoc parts replay from
    the trace. SID-ET debates all-to-all when it does not skip, and tuning its skip rate replays
    SVR-MAD with the run's parameters, so both are recorded even when not asked for (their rows
    are written only for the methods asked for)."""
    out = live_methods(cfg)
    if "sid-et" in cfg.methods:
        out += [m for m in ("all-to-all", "svr-mad" if sid_et_tunes(cfg) else None) if m and m not in out]
    return out


def rebuild_results(folder: RunFolder, cfg: RunConfig, trace: list[dict] | None = None) -> int:
    """Replay the live methods' rows missing for questions committed in the trace; returns how many."""
    from svrmad_local.analysis.replay import replay_all

    if trace is None:
        trace = read_trace(folder.trace) if folder.trace.exists() else []
    have = {(str(r["id"]), r.get("method")) for r in run_rows(folder.results)}
    rows = []
    for m in live_methods(cfg):
        missing = [row for row in trace if (str(row["id"]), m) not in have]
        if missing:
            results = asyncio.run(replay_all(missing, m, cfg.params_for(m)))
            rows += [r.to_row(row_question(row)) for row, r in zip(missing, results)]
    folder.append_results(rows)
    return len(rows)


def stamp(trace: list[dict]) -> dict:
    ids = sorted(str(r["id"]) for r in trace)
    return {"questions": len(ids), "ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()}


def needs_post_hoc(cfg: RunConfig) -> bool:
    return "sid-et" in cfg.methods or cfg.ablations


def post_hoc(folder: RunFolder, cfg: RunConfig, trace: list[dict] | None = None) -> dict:
    """SID-ET over the whole trace and the ablation sweeps; returns run.json's "post_hoc" entry."""
    trace = read_trace(folder.trace) if trace is None else trace
    entry = stamp(trace)
    if "sid-et" in cfg.methods and trace:
        entry["sid_et"] = _sid_et(folder, cfg, trace)
    if cfg.ablations and trace:
        from svrmad_local.analysis.ablations import sweep

        folder.replace_file("ablations.jsonl", sweep(trace, cfg.params_for("svr-mad")))
    return entry


def _sid_et(folder: RunFolder, cfg: RunConfig, trace: list[dict]) -> dict:
    """Append SID-ET's rows over the whole trace; its tuning as run.json records it. A trace that
    lacks the SVR-MAD debates the tuning replays (a folder written before they were recorded) gets
    no SID-ET rows and one line saying how to get them; everything else is kept."""
    from svrmad_local.analysis.replay import sid_et

    try:
        res, rate, thr = sid_et(trace, cfg.params_for("sid-et"), cfg.params_for("svr-mad"), cfg.skip_rate)
    except MissingDebate as exc:
        note(f"SID-ET has no rows: tuning its skip rate replays SVR-MAD, and {str(exc).split(';')[0]}; run again "
             f"on {folder.out} with --skip-rate R (e.g. 0.5) to give SID-ET a fixed skip rate instead")
        return {"error": str(exc)}
    rows = []
    for row, r in zip(trace, res):
        r.params.update(skip_rate=rate, threshold=thr)
        rows.append(r.to_row(row_question(row)))
    folder.append_results(rows)
    return {"skip_rate": rate, "threshold": thr}


def finalize(folder: RunFolder, cfg: RunConfig) -> dict:
    """Rebuild missing results, then the post-hoc parts; records the stamp in run.json."""
    trace = read_trace(folder.trace) if folder.trace.exists() else []
    rebuilt = rebuild_results(folder, cfg, trace)
    entry = post_hoc(folder, cfg, trace) if needs_post_hoc(cfg) else stamp(trace)
    if rebuilt:
        entry["results_rebuilt"] = rebuilt
    meta = folder.read_meta()
    meta["post_hoc"] = entry
    folder.write_meta(meta)
    return entry


def is_stale(folder: RunFolder, cfg: RunConfig) -> bool:
    """True when the post-hoc parts were derived from other questions than the trace now holds."""
    if not needs_post_hoc(cfg) or not folder.trace.exists():
        return False
    done = folder.read_meta().get("post_hoc") or {}
    now = stamp(read_trace(folder.trace))
    return done.get("ids_sha256") != now["ids_sha256"]


def refresh(out) -> None:
    """What `svrmad report` does first, on a folder no run is using: merge part files an unfinished
    data-parallel run left, rebuild results rows lost after their commit, and re-derive the post-hoc
    parts when the trace changed since they were derived (e.g. folders joined by hand)."""
    folder = RunFolder(out, create=False)
    meta = folder.read_meta()
    if "fingerprint" not in meta:  # not written by this version: nothing to check against
        return
    try:
        folder.lock()
    except FolderBusy:
        note(f"a run is using {folder.out}: the report shows what it has saved so far")
        return
    try:
        from svrmad_local.analysis.run_config import RunConfig

        cfg = RunConfig.from_dict(meta["config"], where=folder.run_json)
        folder.cut_torn_tails()
        folder.failed()  # every line names its question: a damaged file is one line here, not a wrong count
        merged = folder.merge_parts()
        if merged:
            note(f"merged {merged} questions from the part files of an unfinished data-parallel run")
        if merged or is_stale(folder, cfg):
            if needs_post_hoc(cfg):
                note("the trace changed since SID-ET was tuned: tuning it again over all of its questions")
            finalize(folder, cfg)
        else:
            rebuilt = rebuild_results(folder, cfg)
            if rebuilt:
                note(f"rebuilt {rebuilt} results rows from trace.jsonl")
    finally:
        folder.unlock()
