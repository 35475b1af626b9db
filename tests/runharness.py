"""`svrmad run` over scripted agents instead of a model: the run layer (folder, commit rule, errors,
resume, post-hoc) in milliseconds. `run_mod.make_backend` is the seam the harness replaces."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from svrmad_local import cli
from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import read_jsonl
from svrmad_local.job import preflight as preflight_mod
from svrmad_local.job import run as run_mod

# id -> (initial answers of 4 agents, {(sender, receiver): new answer}, gold)
SCRIPT = {
    "q0": (["B", "B", "B", "B"], {}, "B"),  # unanimous: skipped
    "q1": (["A", "B", "A", "C"], {(1, 0): "B"}, "A"),
    "q2": (["D", "D", "D", "D"], {}, "D"),  # unanimous: skipped
    "q3": (["D", "D", "B", "A"], {(2, 0): "B", (3, 1): "A"}, "D"),
    "q4": (["C", "B", "C", "B"], {}, "B"),
}
METHODS = "svr-mad,self-consistency,sid-et"


class PerQuestion:
    """A scripted backend per question id; `fail` maps an id to the stage ("initial" or "debate")
    at which that question raises."""

    def __init__(self, fail: dict[str, str] | None = None):
        self.fail = fail or {}  # "hang": the debate never returns (to interrupt it)
        self.by_id = {qid: ScriptedBackend(ans, out, [{"min_ll": -0.2 - 0.3 * i - 0.05 * int(qid[1:])}
                                                      for i in range(len(ans))])
                      for qid, (ans, out, _) in SCRIPT.items()}

    async def initial(self, q, n):
        if self.fail.get(q.id) == "initial":
            raise ValueError(f"prompt of 5000 tokens does not fit the model's context of 2048 ({q.id})")
        return await self.by_id[q.id].initial(q, n)

    async def debate(self, q, own, peers, brief=(), repeat=1):
        if self.fail.get(q.id) == "debate":
            raise RuntimeError(f"scripted failure in a debate of {q.id}")
        if self.fail.get(q.id) == "hang":
            print(f"hanging in {q.id}", file=sys.stderr, flush=True)
            await asyncio.sleep(3600)
        return await self.by_id[q.id].debate(q, own, peers, brief, repeat=repeat)


def write_dataset(path: Path, ids=SCRIPT) -> Path:
    path.write_text("".join(json.dumps({"id": qid, "question": f"question {qid}?", "gold": SCRIPT[qid][2],
                                        "answer_type": "mc", "choices": ["a", "b", "c", "d"]}) + "\n" for qid in ids))
    return path


def use_script(monkeypatch, fail: dict[str, str] | None = None) -> None:
    """Scripted agents instead of a model: no backend built, no checkpoint folder checked."""
    monkeypatch.setattr(run_mod, "make_backend", lambda job: (PerQuestion(fail), dict, lambda: None))
    monkeypatch.setattr(preflight_mod, "check_model", lambda cfg, path: None)


def run(tmp_path: Path, out: Path, *extra: str) -> int:
    data = tmp_path / "qs.jsonl"
    if not data.exists():
        write_dataset(data)
    return cli.main(["run", "--model", str(tmp_path), "--dataset", str(data), "--out", str(out), "--agents", "4",
                     "--limit", "0", "--methods", METHODS, *extra])


def state(out: Path) -> dict:
    """What a finished folder holds, checking that every question is committed once and every live
    method's row exists once; results are keyed (id, method), the last row winning."""
    trace, skipped = read_jsonl(out / "trace.jsonl"), read_jsonl(out / "skipped.jsonl")
    ids = [r["id"] for r in trace + skipped]
    assert len(ids) == len(set(ids)), f"a question committed twice: {sorted(ids)}"
    results = read_jsonl(out / "results.jsonl")
    live = [(r["id"], r["method"]) for r in results if r["method"] != "sid-et"]
    assert len(live) == len(set(live)), "a live method's row written twice"
    return {"trace": {r["id"]: r for r in trace}, "skipped": {r["id"]: r for r in skipped},
            "results": {(r["id"], r["method"]): r for r in results},
            "ablations": read_jsonl(out / "ablations.jsonl"),
            "meta": json.loads((out / "run.json").read_text())}


if __name__ == "__main__":
    # python -m tests.runharness HANG_ID svrmad-args...: `svrmad run` in this process over the script,
    # the debates of question HANG_ID never returning (for a real Ctrl-C)
    run_mod.make_backend = lambda job: (PerQuestion({sys.argv[1]: "hang"}), dict, lambda: None)
    preflight_mod.check_model = lambda cfg, path: None
    sys.exit(cli.main(sys.argv[2:]))
