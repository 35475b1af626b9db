"""Data parallel on the CPU: 2 processes (gloo) launched by accelerate and by torchrun, on a tiny model
and on the embedded default. Every question once, the same answers as one process with the same
seeds, one run folder that `svrmad report` reads like any other, and resume after a rank is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from svrmad_local import cli
from svrmad_local.debate.trace import read_jsonl

from .conftest import make_model

ROOT = Path(__file__).resolve().parents[1]
N = 8
# fp32: a row's values do not depend on its batch mates there (in bf16 the prefill attention's rounding does,
# docs/engine.md), so processes that split the questions compute one process's bits
RUN = ["--max-tokens", "10", "--kv-cache-memory", "4MiB", "--block-size", "4", "--device", "cpu", "--limit", "0",
       "--agents", "3", "--methods", "svr-mad,self-consistency", "--concurrency", "2", "--dtype", "fp32"]


def launch(launcher: str, *argv: str, nproc: int = 2) -> subprocess.Popen:
    """`svrmad` under a launcher, in `nproc` processes; the launchers start fresh interpreters, so they are
    pointed at this checkout with PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if launcher == "torchrun":
        pre = ["torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    else:
        with socket.socket() as s:  # accelerate's default port may be taken by a neighbour
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pre = ["accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    return subprocess.Popen([sys.executable, "-m", *pre, "-m", "svrmad_local", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_after_its_first_commit(proc: subprocess.Popen, part: Path) -> None:
    """SIGKILL the process that writes the part folder `part`, once it has committed a question."""
    deadline = time.monotonic() + 300
    while not any(read_jsonl(part / name) for name in ("trace.jsonl", "skipped.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, f"{part.name} committed nothing"
        time.sleep(0.05)
    os.kill(json.loads((part / "rank.json").read_text())["pid"], signal.SIGKILL)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def outcome(out: Path) -> dict:
    """Per question: the agents' and debates' texts and every method's answer, NComm and tokens;
    checking each question is in the folder exactly once."""
    trace, skipped = read_jsonl(out / "trace.jsonl"), read_jsonl(out / "skipped.jsonl")
    ids = [r["id"] for r in trace + skipped]
    assert len(ids) == len(set(ids)), "a question was written twice"
    got = {r["id"]: {"texts": [a["text"] for a in r["agents"]] + sorted(d["id"] + d["text"] for d in r["debates"])}
           for r in trace}
    got.update({r["id"]: {"answers": r["answers"]} for r in skipped})
    for r in read_jsonl(out / "results.jsonl"):
        got[r["id"]][r["method"]] = (r["answer"], r["ncomm"], r["tokens"], r["correct"])
    assert not (out / "parts").exists()
    return got


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    """A tiny checkpoint, N questions and the single-process run of them (the reference)."""
    root = tmp_path_factory.mktemp("dp")
    ck = root / "model"
    make_model("llama", vocab=len(tiny_tokenizer), seed=3).save_pretrained(ck)
    tiny_tokenizer.save_pretrained(ck)
    data = root / "qs.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + {i + 1}? Answer with a number.",
                                        "gold": str(2 * i + 1), "answer_type": "math"}) + "\n" for i in range(N)))
    assert cli.main(["run", "--model", str(ck), "--dataset", str(data), "--out", str(root / "single"), *RUN,
                     "--concurrency", "8"]) == 0  # seeds are per call: concurrency changes no answer
    return ck, data, root


def test_accelerate_two_processes_equal_one(tiny, capsys):
    ck, data, root = tiny
    out = root / "accelerate"
    printed = finish(launch("accelerate", "run", "--model", str(ck), "--dataset", str(data), "--out", str(out), *RUN))
    assert "2 processes" in printed
    assert outcome(out) == outcome(root / "single")
    meta = json.loads((out / "run.json").read_text())
    assert meta["world_size"] == 2 and [r["rank"] for r in meta["ranks"]] == [0, 1]
    assert sum(r["questions"] for r in meta["ranks"]) == N and all(r["questions"] > 0 for r in meta["ranks"])
    assert meta["totals"]["questions"] == N and meta["totals"]["engine"]["requests"] > 0
    # the report of a data-parallel run is the report of a run
    def table(folder):  # the printed summary, without the cache-dependent columns (computed, KV saved)
        capsys.readouterr()
        assert cli.main(["report", str(folder)]) == 0
        rows = [re.split(r"\s{2,}", line.strip()) for line in capsys.readouterr().out.splitlines()[:4]]
        return [r[:6] + r[8:] for r in rows]

    assert table(out) == table(root / "single")


def test_torchrun_resume_after_one_rank_is_killed(tiny):
    ck, data, root = tiny
    out = root / "killed"
    argv = ["run", "--model", str(ck), "--dataset", str(data), "--out", str(out), *RUN]
    proc = launch("torchrun", *argv)
    kill_after_its_first_commit(proc, out / "parts" / "rank-1")
    proc.communicate(timeout=300)
    assert proc.returncode != 0  # torchrun stops the whole group when a rank dies
    saved = {r["id"] for d in [out, *sorted((out / "parts").iterdir())] for name in ("trace.jsonl", "skipped.jsonl")
             for r in read_jsonl(d / name)}
    assert 0 < len(saved) < N, "the kill came too late to test a resume"
    # resume with another world size: one process merges the parts and runs the rest
    assert cli.main(argv) == 0
    assert outcome(out) == outcome(root / "single")
    meta = json.loads((out / "run.json").read_text())
    assert meta["world_size"] == 1 and meta["launches"][-1]["questions_run"] == N - len(saved)


def test_torchrun_on_the_embedded_default(tmp_path):
    from svrmad_local.models.default import ensure_default_model

    ensure_default_model()  # once, before two ranks look for it (downloads it on a fresh machine)
    argv = ["--dataset", "gsm8k", "--limit", "2", "--agents", "2", "--max-tokens", "4", "--concurrency", "1",
            "--device", "cpu", "--methods", "svr-mad", "--dtype", "fp32"]
    finish(launch("torchrun", "run", "--out", str(tmp_path / "dp"), *argv))
    assert cli.main(["run", "--out", str(tmp_path / "single"), *argv]) == 0
    assert outcome(tmp_path / "dp") == outcome(tmp_path / "single")
    ranks = json.loads((tmp_path / "dp" / "run.json").read_text())["ranks"]
    assert len(ranks) == 2 and sum(r["questions"] for r in ranks) == 2


def test_torchrun_tensor_parallel_run_equals_one_process(tiny):
    """`--tp 2`: one engine over both processes (the model split by our plan, models/shard.py), rank 0
    running the questions; the folder is the single-process one (no parts, world size recorded)."""
    ck, data, root = tiny
    out = root / "tp"
    finish(launch("torchrun", "run", "--model", str(ck), "--dataset", str(data), "--out", str(out), "--tp", "2", *RUN))
    assert outcome(out) == outcome(root / "single")
    assert json.loads((out / "run.json").read_text())["config"]["tp"] == 2
