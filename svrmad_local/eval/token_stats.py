"""Per-token statistics of a run's responses (`svrmad run --save-token-stats`), beside the trace.

trace.jsonl keeps per-response signals only; a researcher of where along a response confidence
drops needs every token's log-prob and entropy. Those go to RUN_DIR/token_stats/, one numpy .npz
per debated question (the questions of trace.jsonl), columnar and compressed:

    qid       the question id (a 0-d string array)
    rids      the response ids, initial responses then debates, as in the trace
    offsets   int64 [R + 1]: response r's tokens are rows offsets[r]:offsets[r + 1]
    logprob   float32 [T]: log p of each generated token under the raw distribution
    entropy   float32 [T]: entropy of that distribution (nats)

8 bytes a token before compression (two float32 columns); `svrmad signals` reports what the run's
files actually take. A question's file is written (aside, then renamed) before its trace line, so a
committed question always has its file; a question that runs again rewrites it with the same
numbers (its samples are seeded by its id). Reasoning models: the whole completion, reasoning included.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterable

import numpy as np

FOLDER = "token_stats"


def file_name(qid: str) -> str:
    """A file name for any question id: its safe characters, then a short hash (ids may hold '/')."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", qid)[:80]
    return f"{safe}-{hashlib.sha256(qid.encode()).hexdigest()[:8]}.npz"


def write(run_dir, qid: str, responses: Iterable) -> Path:
    """Write question `qid`'s file from responses carrying `token_stats` = (logprobs, entropies);
    a response without them (a debate not sent: its prompt outgrew the context) has no tokens."""
    rids, lps, ents = [], [], []
    for r in responses:
        lp, ent = r.token_stats if r.token_stats is not None else ((), ())
        rids.append(r.id)
        lps.append(np.asarray(lp, dtype=np.float32))
        ents.append(np.asarray(ent, dtype=np.float32))
    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(qid)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, qid=np.array(qid), rids=np.array(rids, dtype=str),
                            offsets=np.cumsum([0] + [len(x) for x in lps], dtype=np.int64),
                            logprob=np.concatenate(lps) if lps else np.zeros(0, np.float32),
                            entropy=np.concatenate(ents) if ents else np.zeros(0, np.float32))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read(run_dir) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """{(question id, response id): (logprob, entropy)} of every file in RUN_DIR/token_stats/
    (empty when the run did not save them)."""
    out = {}
    for path in sorted((Path(run_dir) / FOLDER).glob("*.npz")):
        with np.load(path) as z:
            qid, offsets = str(z["qid"]), z["offsets"]
            for i, rid in enumerate(z["rids"]):
                a, b = offsets[i], offsets[i + 1]
                out[qid, str(rid)] = (z["logprob"][a:b], z["entropy"][a:b])
    return out


def bytes_per_token(run_dir) -> tuple[int, int]:
    """(bytes on disk, tokens) of RUN_DIR/token_stats/."""
    size = tokens = 0
    for path in (Path(run_dir) / FOLDER).glob("*.npz"):
        size += path.stat().st_size
        with np.load(path) as z:
            tokens += int(z["offsets"][-1])
    return size, tokens
