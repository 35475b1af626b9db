"""A run folder on disk (docs/formats.md): its files, the per-question commit rule, the lock, and
the merge of the part files that data-parallel ranks (or shards) write.

The commit rule: a question is done exactly when its line is complete in trace.jsonl (debated) or
in skipped.jsonl (unanimous). That line is a single write of a single line, flushed and fsynced
before anything else about the question is written, so it is the one record that decides. The
question's results.jsonl rows are written after it and are derived data: rows a crash left out
are rebuilt from the trace by replay, without a model (`analysis.posthoc.rebuild_results`). A torn
last line (a crash in the middle of a write) is cut when the folder is opened; its question is
then simply not done and runs again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from svrmad_local.debate.trace import TornLineWarning, TraceError, iter_jsonl
from svrmad_local.errors import UserError

TRACE, RESULTS, SKIPPED, ERRORS = "trace.jsonl", "results.jsonl", "skipped.jsonl", "errors.jsonl"
DATA_FILES = (TRACE, RESULTS, SKIPPED, ERRORS)
RUN_JSON, LOCK, PARTS = "run.json", "run.lock", "parts"


class FolderBusy(UserError, RuntimeError):
    """Another live run holds the folder's lock."""


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised while writing `path` names it: a full disk's write says only "[Errno 28]
    No space left on device", and a run writes a dozen files."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


def write_lines(path: Path, rows: Iterable[dict], sync: bool = False) -> None:
    """Append rows as JSONL in one write; `sync` also fsyncs (a commit record)."""
    data = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
    if not data:
        return
    with naming(path), open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def write_json(path: Path, obj: dict) -> None:
    """Replace a JSON file atomically: a crash leaves the old or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with naming(tmp):
        tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


def cut_torn_tail(path: Path) -> bool:
    """Cut a last line without its newline (a run killed mid-write); True if there was one."""
    if not path.exists():
        return False
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        # find the last newline, reading backwards in chunks
        pos, keep = size, 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
        f.truncate(keep)
    return True


class RunFolder:
    """The files of one run folder. With `part`, question files go to parts/<part>/ (one writer per
    part: a data-parallel rank) and are merged into the folder's own files by `merge_parts`."""

    def __init__(self, out: str | Path, part: str | None = None, create: bool = True):
        self.out = Path(out)
        self.dir = self.out / PARTS / part if part else self.out
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.trace, self.results = self.dir / TRACE, self.dir / RESULTS
        self.skipped, self.errors = self.dir / SKIPPED, self.dir / ERRORS
        self.run_json = self.out / RUN_JSON
        self._lock_file = None
        self._broken: BaseException | None = None

    def _write(self, path: Path, rows: Iterable[dict], sync: bool = False) -> None:
        """Every append goes through here: after a write that failed (it may have left half a line),
        nothing more is appended, so the torn line stays the last one and is cut on the next open."""
        if self._broken is not None:
            raise RuntimeError(f"an earlier write to {self.dir} failed ({self._broken!r}); not writing more")
        try:
            write_lines(path, rows, sync)
        except BaseException as exc:
            self._broken = exc
            raise

    # -- opening ------------------------------------------------------------------------------
    def cut_torn_tails(self) -> list[str]:
        """Cut torn last lines of this folder's files; the names of the files that had one."""
        return [name for name in DATA_FILES if cut_torn_tail(self.dir / name)]

    def lock(self, shared: bool = False) -> None:
        """Hold a lock on the folder for this process's lifetime (released by the OS when it exits,
        crash included): exclusive for a writer, `shared` for a reader (`svrmad merge` reading a
        source), which only has to keep a writer out and may find the folder read-only. Raises
        FolderBusy naming the holder."""
        import fcntl

        try:
            f = open(self.out / LOCK, "a+", encoding="utf-8")
        except OSError:
            if not shared:
                raise
            try:  # a read-only folder: its lock file, if a run ever made one, can still be locked
                f = open(self.out / LOCK, encoding="utf-8")
            except FileNotFoundError:
                return  # nothing can write a folder that cannot hold a lock file
        try:
            fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise FolderBusy(f"{self.out} is in use by another run ({holder}); wait for it to finish, "
                             "or pass another --out") from None
        if not shared:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        self._lock_file = f

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- the commit rule ----------------------------------------------------------------------
    def committed_ids(self) -> set[str]:
        """Questions done: a complete line in trace.jsonl or skipped.jsonl."""
        return {i for name in (TRACE, SKIPPED) for i in ids(self.dir / name)}

    def commit_skipped(self, row: dict) -> None:
        self._write(self.skipped, [row], sync=True)

    def commit_debated(self, trace_row: dict, result_rows: list[dict]) -> None:
        self._write(self.trace, [trace_row], sync=True)  # the commit
        self._write(self.results, result_rows)  # derived: rebuilt from the trace if lost

    def append_results(self, rows: list[dict]) -> None:
        self._write(self.results, rows)

    def replace_file(self, name: str, rows: list[dict]) -> None:
        """Write a whole derived file (ablations.jsonl) atomically."""
        path = self.out / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        self._write(tmp, rows, sync=True)
        os.replace(tmp, path)

    def record_error(self, qid: str, stage: str, message: str, **extra) -> None:
        self._write(self.errors, [{"id": qid, "stage": stage, "message": message, **extra}], sync=True)

    def failed(self) -> dict[str, dict]:
        """The last error of each question that failed and is still not done."""
        done = self.committed_ids()
        return {str(e["id"]): e for e in rows(self.errors) if str(e["id"]) not in done}

    # -- run.json -----------------------------------------------------------------------------
    def read_meta(self) -> dict:
        """run.json; a file that is not a JSON object, or whose settings are not objects, is a
        ValueError naming it (a file edited by hand or damaged), never a crash further on."""
        if not self.run_json.exists():
            return {}
        try:
            meta = json.loads(self.run_json.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{self.run_json} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.run_json} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{self.run_json} is a JSON {type(meta).__name__}, not the object a run writes")
        bad = [k for k in ("config", "fingerprint", "post_hoc") if k in meta and not isinstance(meta[k], dict)]
        if bad:
            raise ValueError(f"{self.run_json}: {bad[0]} is not a JSON object; the file is damaged (move it away "
                             "to start the folder's settings afresh)")
        return meta

    def write_meta(self, meta: dict) -> None:
        write_json(self.run_json, meta)

    # -- merging ------------------------------------------------------------------------------
    def merge_from(self, src: Path, drop_methods: Iterable[str] = ()) -> dict[str, int]:
        """Append the question lines of folder `src` that this folder lacks: trace and skipped lines
        of questions not committed here (commit records first, then their results), results rows
        whose (id, method) is new, error lines not yet here. Idempotent, so a merge cut short by a
        crash is simply done again. `drop_methods`: result rows not to take (SID-ET's, tuned per
        folder, are re-tuned on the merged one). `src` is only read (it may be read-only): a torn
        last line there is passed over, not cut. Returns lines added per file."""
        src = Path(src)
        done = self.committed_ids()
        added = {}
        for name in (TRACE, SKIPPED):
            new = [r for r in rows(src / name, whole=True) if str(r["id"]) not in done]
            new = list({str(r["id"]): r for r in new}.values())
            self._write(self.dir / name, new, sync=True)
            added[name] = len(new)
        have = {(str(r["id"]), r.get("method")) for r in rows(self.results)}
        drop = set(drop_methods)
        new = [r for r in rows(src / RESULTS, whole=True)
               if r.get("method") not in drop and (str(r["id"]), r.get("method")) not in have]
        self._write(self.results, new)
        added[RESULTS] = len(new)
        seen = {json.dumps(e, sort_keys=True) for e in rows(self.errors)}
        new = [e for e in rows(src / ERRORS, whole=True) if json.dumps(e, sort_keys=True) not in seen]
        self._write(self.errors, new)
        added[ERRORS] = len(new)
        return added

    def part_dirs(self) -> list[Path]:
        root = self.out / PARTS
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def merge_parts(self) -> int:
        """Merge every parts/<part>/ into the folder's files, then delete it. Returns the number
        of question lines taken."""
        taken = 0
        for part in self.part_dirs():
            added = self.merge_from(part)
            taken += added[TRACE] + added[SKIPPED]
            shutil.rmtree(part)
        root = self.out / PARTS
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        return taken


def rows(path: Path, whole: bool = False) -> list[dict]:
    """The lines of a run file (trace, results, skipped, errors), each checked to name its question:
    a line without an "id" is a TraceError naming the file and line, not a KeyError further on.
    `whole`: for a file this process must not cut (a merge's source, perhaps read-only), leave out
    a last line its writer did not finish (no newline: not committed, as `cut_torn_tail` would cut)."""
    torn = None
    if whole and path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            torn = data.count(b"\n") + 1
    out = []
    with warnings.catch_warnings():
        if torn:
            warnings.simplefilter("ignore", TornLineWarning)
        for line, row in iter_jsonl(path):
            if line == torn:
                continue
            if row.get("id") is None:
                raise TraceError(f"{path}:{line}: no \"id\" (every line of a run file names its question)")
            out.append(row)
    return out


def ids(path: Path) -> list[str]:
    return [str(r["id"]) for r in rows(path)]


def note(message: str) -> None:
    print(f"svrmad: {message}", file=sys.stderr)
