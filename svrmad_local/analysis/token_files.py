"""Per-token statistics of a run's responses (`svrmad run --save-token-stats`), beside the trace.

trace.jsonl keeps per-response signals only; a researcher of where along a response confidence
drops needs every token's log-prob and entropy. Those go to RUN_DIR/token_stats/, one numpy .npz
per debated question (the questions of trace.jsonl), columnar and compressed:

    qid       the question id (a 0-d string array)
    rids      the response ids, initial responses then debates, as in the trace
    offsets   int64 [R + 1]: response r's tokens are rows offsets[r]:offsets[r + 1]
    logprob   float32 [T]: log p of each generated token under the raw distribution
    entropy   float32 [T]: entropy of that distribution (nats)
    settings  the settings fingerprint of the run that wrote it, as run.json records it (JSON text;
              absent in files written before it was kept)

8 bytes a token before compression (two float32 columns); `svrmad signals` reports what the run's
files actually take. A question's file is written (aside, then renamed) before its trace line, so a
committed question always has its file; a question that runs again rewrites it with the same
numbers (its samples are seeded by its id). Reasoning models: the whole completion, reasoning included.

Written before the commit record, a file is not itself a record: a run killed between the two
leaves a file whose question is not done, and a folder taken over by a run with other settings
(docs/formats.md) still holds the files of the run before. So a reader takes a file only where it
belongs to the folder's run (`belonging`): its question committed in trace.jsonl, each of its
responses in that question's trace line with as many tokens as the line says it generated, and
the settings it was written under those of run.json. Anything else is left out and named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from svrmad_local.analysis.folder import TRACE, RunFolder, naming, rows
from svrmad_local.analysis.run_config import diff_fingerprints

FOLDER = "token_stats"
COLUMNS = ("qid", "rids", "offsets", "logprob", "entropy")


def file_name(qid: str) -> str:
    """A file name for any question id: its safe characters, then a short hash (ids may hold '/')."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", qid)[:80]
    return f"{safe}-{hashlib.sha256(qid.encode()).hexdigest()[:8]}.npz"


def _settings(run_dir: Path) -> dict | None:
    """The settings fingerprint run.json records (None for a folder without one)."""
    fingerprint = RunFolder(run_dir, create=False).read_meta().get("fingerprint")
    return fingerprint if isinstance(fingerprint, dict) else None


def write(run_dir, qid: str, responses: Iterable, settings: dict | None) -> Path:
    """Write question `qid`'s file from responses carrying `token_stats` = (logprobs, entropies);
    a response without them (a debate not sent: its prompt outgrew the context) has no tokens.
    `settings`: the writing run's fingerprint (`RunConfig.fingerprint`, which the run also wrote
    into run.json), given by the run rather than read back from run.json for every question."""
    rids, lps, ents = [], [], []
    for r in responses:
        lp, ent = r.token_stats if r.token_stats is not None else ((), ())
        rids.append(r.id)
        lps.append(np.asarray(lp, dtype=np.float32))
        ents.append(np.asarray(ent, dtype=np.float32))
    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    extra = {"settings": np.array(json.dumps(settings, sort_keys=True))} if settings is not None else {}
    path = folder / file_name(qid)
    tmp = path.with_name(path.name + ".tmp")
    with naming(tmp), open(tmp, "wb") as f:
        np.savez_compressed(f, qid=np.array(qid), rids=np.array(rids, dtype=str),
                            offsets=np.cumsum([0] + [len(x) for x in lps], dtype=np.int64),
                            logprob=np.concatenate(lps) if lps else np.zeros(0, np.float32),
                            entropy=np.concatenate(ents) if ents else np.zeros(0, np.float32), **extra)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- reading one file


class Damaged(ValueError):
    """A file in token_stats/ that is not one this module writes (truncated, emptied, edited)."""


@dataclass
class Saved:
    """One question's file, read and checked."""

    path: Path
    qid: str
    rids: list[str]
    offsets: np.ndarray
    logprob: np.ndarray
    entropy: np.ndarray
    settings: dict | None

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def tracks(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{response id: (logprob, entropy)}."""
        o = self.offsets
        return {rid: (self.logprob[o[i]:o[i + 1]], self.entropy[o[i]:o[i + 1]]) for i, rid in enumerate(self.rids)}


def load(path: Path) -> Saved:
    """One file, every column read and its layout checked; Damaged names the file and the fault."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in COLUMNS if k not in z.files]
            if missing:
                raise Damaged(f"{path}: has no {', '.join(missing)} (not a token-stats file)")
            a = {k: z[k] for k in z.files}
    except Damaged:
        raise
    except Exception as exc:  # numpy and zipfile raise a dozen kinds for a truncated or foreign file
        raise Damaged(f"{path}: cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    problem = _layout(a)
    if problem is None and path.name != file_name(str(a["qid"])):
        problem = f"holds question {str(a['qid'])!r}, whose file is {file_name(str(a['qid']))}"
    settings = None
    if problem is None and "settings" in a:
        try:
            settings = json.loads(str(a["settings"]))
        except json.JSONDecodeError:
            settings = None
        if not isinstance(settings, dict):
            problem = "its settings are not a JSON object"
    if problem:
        raise Damaged(f"{path}: {problem}")
    return Saved(path, str(a["qid"]), [str(r) for r in a["rids"]], a["offsets"], a["logprob"], a["entropy"], settings)


def _layout(a: dict) -> str | None:
    """What is wrong with the columns' shapes and kinds, or None."""
    text = {"qid": 0, "rids": 1, "settings": 0}
    for k, ndim in text.items():
        if k in a and (a[k].ndim != ndim or a[k].dtype.kind != "U"):
            return f"{k} is not {'a string' if ndim == 0 else 'a list of strings'}"
    offsets, lp, ent = a["offsets"], a["logprob"], a["entropy"]
    if lp.ndim != 1 or ent.ndim != 1 or lp.dtype.kind != "f" or ent.dtype.kind != "f" or len(lp) != len(ent):
        return "logprob and entropy are not two float columns of one length"
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != len(a["rids"]) + 1:
        return f"offsets are not {len(a['rids']) + 1} integers (one more than the responses)"
    if offsets[0] != 0 or np.any(np.diff(offsets) < 0) or offsets[-1] != len(lp):
        return f"offsets do not run from 0 up to the {len(lp)} tokens held"
    return None


# ---------------------------------------------------------------- the files that belong to a run


def _trace_lines(run_dir: Path) -> dict[str, dict[str, int | None]]:
    """{question id: {response id: completion tokens}} of the folder's committed debated questions
    (its trace and the part files of data-parallel ranks not merged yet)."""
    folder = RunFolder(run_dir, create=False)
    out: dict[str, dict[str, int | None]] = {}
    for d in (folder.dir, *folder.part_dirs()):
        for row in rows(d / TRACE):
            responses = [*(row.get("agents") or []), *(row.get("debates") or [])]
            out[str(row["id"])] = {str(r.get("id", r.get("agent"))): r.get("completion_tokens") for r in responses}
    return out


def _foreign(f: Saved, lines: dict, settings: dict | None) -> str | None:
    """Why a file is not the folder's run's own, or None."""
    line = lines.get(f.qid)
    if line is None:
        return f"question {f.qid!r} is not committed in {TRACE} (a run stopped before its line, or the run before a takeover)"
    if f.settings is not None:
        differ = diff_fingerprints(f.settings, settings) if settings is not None else ["run.json records no settings"]
        if differ:
            return f"written under other settings than run.json's ({'; '.join(differ[:2])})"
    for rid, (lp, _) in f.tracks().items():
        if rid not in line:
            return f"response {rid!r} is not in question {f.qid!r}'s trace line"
        if line[rid] is not None and line[rid] != len(lp):
            return f"response {rid!r} has {len(lp)} tokens here and {line[rid]} in the trace"
    return None


def belonging(run_dir) -> tuple[dict[str, Saved], list[str]]:
    """({question id: file} of the files that belong to the folder's run, one line per file left
    out saying which and why)."""
    run_dir = Path(run_dir)
    paths = sorted((run_dir / FOLDER).glob("*.npz"))
    if not paths:
        return {}, []
    lines, settings = _trace_lines(run_dir), _settings(run_dir)
    kept, left = {}, []
    for path in paths:
        try:
            f = load(path)
        except Damaged as exc:
            left.append(str(exc))
            continue
        why = _foreign(f, lines, settings)
        if why:
            left.append(f"{path}: {why}")
        else:
            kept[f.qid] = f
    return kept, left


def read(run_dir) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """{(question id, response id): (logprob, entropy)} of the files that belong to the run (empty
    when it did not save them)."""
    kept, _ = belonging(run_dir)
    return {(qid, rid): track for qid, f in kept.items() for rid, track in f.tracks().items()}


def footprint(files: Iterable[Saved]) -> tuple[int, int]:
    """(bytes on disk, tokens) of `files`."""
    files = list(files)
    return sum(f.path.stat().st_size for f in files), sum(f.tokens for f in files)


def bytes_per_token(run_dir) -> tuple[int, int]:
    """(bytes on disk, tokens) of the files that belong to the run."""
    return footprint(belonging(run_dir)[0].values())


def merge(src, out) -> tuple[int, list[str]]:
    """Copy into OUT's token_stats/ the files of SRC that belong to SRC's run, for the debated
    questions OUT has committed and holds no file of its own for (`svrmad merge`, after the trace
    lines). Returns (files copied, the lines of SRC's files left out)."""
    theirs, left = belonging(src)
    if not theirs:
        return 0, left
    ours, _ = belonging(out)
    wanted = set(_trace_lines(Path(out)))
    folder = Path(out) / FOLDER
    copied = 0
    for qid, f in theirs.items():
        if qid in wanted and qid not in ours:
            folder.mkdir(exist_ok=True)
            tmp = folder / (f.path.name + ".tmp")
            with naming(tmp):
                shutil.copyfile(f.path, tmp)
            os.replace(tmp, folder / f.path.name)
            copied += 1
    return copied, left
