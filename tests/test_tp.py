"""Tensor parallelism on the CPU (gloo): our own plan (models/shard.py) gives the same tokens as one
process, over plain and packed checkpoints in the published layouts, and replicas of TP groups share
the questions of a run.

Attention is split by heads, MLPs by columns/rows, routed experts by expert; the row-parallel blocks'
partial sums are added in another order than one process adds them, so log-probs are compared within
LOGPROB_TOL and greedy tokens exactly (on these tiny models no near-tie flips them)."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from svrmad_local import cli
from svrmad_local.debate.trace import read_jsonl
from svrmad_local.job.launch import Dist
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.scheduler import StepInput
from svrmad_local.engine.tp import HEADER, KEEP, TableMirror, TablesDisagree, keep_for, pack, unpack
from svrmad_local.models.loader import load_model
from svrmad_local.models.plan import make_plan
from svrmad_local.models.quant.formats import Reader

from .conftest import make_model
from .model_zoo import make_zoo_model
from .quant_zoo import deepseek_config, write_deepseek, write_gpt_oss
from .test_dp import (N, RUN, finish, kill_after_its_first_commit, launch, outcome,  # noqa: F401 (tiny: the fixture)
                      tiny)
from .tp_worker import CONFIG, crowded, crowded_workload, resident_bytes, workload

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("tp"))


def write_checkpoints(root: Path) -> dict[str, Path]:
    """One of each family the plan covers: a Llama whose 2 KV heads split (its LM head tied), a Qwen3-MoE (experts by
    expert), GPT-OSS with MXFP4 experts and DeepSeek-V3 in FP8 (latent attention, ragged blocks)."""
    llama = make_model("llama", layers=2)
    llama.config.tie_word_embeddings = True  # as SmolLM2 (the embedded default): one tensor, read once
    llama.tie_weights()
    llama.save_pretrained(root / "llama")
    make_zoo_model("qwen3-moe", 0).save_pretrained(root / "qwen3-moe")
    gpt_oss, _ = write_gpt_oss(root)
    # sizes that split over 2 ranks on the 16x16 blocks (dense 96 -> 48, shared expert 32 -> 16); hidden 72
    # and kv_a's 24 rows stay ragged (whole on every rank)
    deepseek, _ = write_deepseek(root, config=deepseek_config(intermediate_size=96, moe_intermediate_size=32))
    return {"llama": root / "llama", "qwen3-moe": root / "qwen3-moe", "gpt-oss": gpt_oss, "deepseek": deepseek}


def run_worker(out: Path, *args: str, nproc: int = 2, env: dict | None = None) -> dict | None:
    """tests/tp_worker.py under torchrun in `nproc` processes; what its leader wrote (None: nothing at `out`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "tests" / "tp_worker.py"), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    return json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-out") / "tp.json"
    return run_worker(out, str(out), *map(str, checkpoints.values()))


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "gpt-oss", "deepseek"])
def test_tensor_parallel_matches_one_process(name, checkpoints, two_ranks):
    tp = two_ranks[str(checkpoints[name])]
    lm = load_model(checkpoints[name], device="cpu", dtype="fp32")
    one = workload(Engine(lm.model, None, EngineConfig(**CONFIG)))
    assert tp["world"] == 2 and tp["decoder"].startswith("ours")  # our decoder, its all-reduces written in its loop
    assert tp["greedy"] == one["greedy"] and tp["forks"] == one["forks"]
    for a, b in zip(tp["greedy_logprobs"], one["greedy_logprobs"]):
        assert a == pytest.approx(b, abs=LOGPROB_TOL)
    assert tp["score"] == pytest.approx(one["score"], abs=LOGPROB_TOL)
    assert tp["computed"] == one["computed"]  # the same prefix reuse: the leader scheduled it all
    # the collectives the plan states: two all-reduces a decoder layer a step
    c = tp["collectives"]
    assert c["steps"] > 0 and c["all_reduce"] == 2 * lm.model.config.num_hidden_layers * c["steps"]
    # each rank caches its own half of the KV heads; the latent (DeepSeek) is whole on every rank
    heads = tp["kv_shape_here"][0]
    assert heads == (1 if name == "deepseek" else lm.model.config.num_key_value_heads // 2)
    # what a rank holds: the plan's count for --tp 2 (unpacked weights held in fp32 here), and less than
    # the whole model
    plan = make_plan(checkpoints[name], 2, 2**40, tp=2, held_as="F32")
    for held in tp["resident"]:
        assert plan["weight_bytes_per_gpu"] / 1.1 <= held <= plan["weight_bytes_per_gpu"] * 1.1
        assert held < resident_bytes(lm.model)


@pytest.fixture(scope="module")
def two_ranks_static(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-static") / "tp.json"
    return run_worker(out, "--graphs", "static", str(out), *map(str, checkpoints.values()))


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "gpt-oss", "deepseek"])
def test_the_static_decode_path_runs_on_every_rank_and_gives_the_same_tokens(name, checkpoints, two_ranks,
                                                                            two_ranks_static):
    """cuda_graphs="static" under --tp 2 (what a CUDA graph under NCCL would record, run eagerly over
    gloo): every rank runs every decode step through the static path, each follower filling its buffers
    from the step it received, with the same all-reduces in the same order, and the tokens are one
    process's and the dynamic tensor-parallel path's."""
    st, dyn = two_ranks_static[str(checkpoints[name])], two_ranks[str(checkpoints[name])]
    lm = load_model(checkpoints[name], device="cpu", dtype="fp32")
    one = workload(Engine(lm.model, None, EngineConfig(**CONFIG, cuda_graphs="static")))
    assert st["graphs"] == "static (eager)" and dyn["static_steps"] == [0, 0]
    steps = st["static_steps"]
    assert steps[0] > 0 and steps[1] == steps[0], steps  # the followers took the same static steps
    assert st["greedy"] == dyn["greedy"] == one["greedy"] and st["forks"] == dyn["forks"] == one["forks"]
    for a, b in zip(st["greedy_logprobs"], dyn["greedy_logprobs"]):
        assert a == pytest.approx(b, abs=LOGPROB_TOL)
    c = st["collectives"]
    assert c["all_reduce"] == 2 * lm.model.config.num_hidden_layers * c["steps"]


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_overlap_under_tensor_parallel_gives_one_process_tokens(name, checkpoints, tmp_path, two_ranks_static):
    """overlap="on" under --tp 2 (the static path, eagerly, over gloo): the leader launches each decode step
    before it reads the one before, and every rank takes the step's ids from the leader's device rows (a
    broadcast in the step, in the same order on every rank); tokens, forks and log-probs are those of the
    same run without overlap."""
    out = tmp_path / "tp.json"
    on = run_worker(out, "--overlap", str(out), str(checkpoints[name]))[str(checkpoints[name])]
    st = two_ranks_static[str(checkpoints[name])]
    assert on["overlapped_steps"] > 0 and on["static_steps"][0] == on["static_steps"][1] > 0
    assert on["worker_ended"] == [True, True]  # every rank's worker thread ended before the interpreter's exit
    assert on["greedy"] == st["greedy"] and on["forks"] == st["forks"] and on["computed"] == st["computed"]
    for a, b in zip(on["greedy_logprobs"], st["greedy_logprobs"]):
        assert a == pytest.approx(b, abs=1e-6)


@pytest.fixture(scope="module")
def stand_in_ranks(checkpoints, tmp_path_factory):
    """What each rank of tp_worker.py's `--stand-in` run wrote (the leader's, then the follower's)."""
    out = tmp_path_factory.mktemp("tp-stand-in") / "stand-in"
    run_worker(out, "--stand-in", str(out), str(checkpoints["llama"]))
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def test_graphs_under_tensor_parallel_are_captured_on_every_rank_or_on_none(checkpoints, stand_in_ranks):
    """The capture path under --tp on the CPU, with tests/test_graphs.py's stand-in graph API and the
    group taken as NCCL's: every shape is captured at start-up on both ranks, except those whose capture
    failed on one rank (rank 1's at 4 rows), which run eagerly on both; every rank replays the same
    steps and the tokens are one process's."""
    lead, follower = stand_in_ranks
    assert lead["graphs"] == follower["graphs"] and lead["graphs"] and all(p != 4 for p, _ in lead["graphs"])
    assert [f[:2] for f in lead["failed"]] == [f[:2] for f in follower["failed"]] != []
    assert all(p == 4 for p, _, _ in lead["failed"])
    assert all(why == "its capture failed on tensor-parallel rank 1" for _, _, why in lead["failed"])
    assert all(why == "RuntimeError: injected" for _, _, why in follower["failed"])
    assert lead["replays"] == follower["replays"] > 0
    one = workload(Engine(load_model(checkpoints["llama"], device="cpu", dtype="fp32").model, None,
                          EngineConfig(**CONFIG)))
    assert lead["greedy"] == one["greedy"] and lead["forks"] == one["forks"]
    assert lead["info"].startswith(f"on ({len(lead['graphs'])} shapes captured, {lead['replays']} steps replayed; ")


def test_a_followers_static_step_ends_at_the_hidden_states_and_the_leaders_samples_inside(checkpoints,
                                                                                          stand_in_ranks,
                                                                                          two_ranks_static):
    """Under --tp 2 only the leader's tokens are read, so only its static step (and the graph recording it)
    runs the LM head and the sampling: a follower's ends at the hidden states and its head never runs while
    it serves, graphs replayed (stand-in) or eager (cuda_graphs="static"), while the tokens stay one
    process's (the tests above)."""
    lead, follower = stand_in_ranks
    assert lead["sampling"] and not follower["sampling"]
    assert lead["replays"] == follower["replays"] > 0
    assert lead["sampled_inside"] > 0 and lead["head_calls"] > 0  # the leader still samples inside its graphs
    assert follower["sampled_inside"] == 0 and follower["head_calls"] == 0
    assert "ends at the hidden states" in follower["info"] and "hidden states" not in lead["info"]
    for name in checkpoints:
        st = two_ranks_static[str(checkpoints[name])]
        assert st["sampling"] == [True, False] and st["sampled_inside"][0] > 0, (name, st)
        assert st["sampled_inside"][1] == 0 and st["head_calls"][1] == 0, (name, st)


def test_four_ranks_one_kv_head_and_one_expert_each(tmp_path):
    """TP 4 on a Qwen3-MoE with 4 KV heads and 4 experts: each rank holds one of each."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    config = CONFIG_MAPPING["qwen3_moe"](vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, intermediate_size=128, decoder_sparse_step=1,
                                         max_position_embeddings=512, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is small: scale so greedy ties are rare (as conftest.make_model)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    model.save_pretrained(tmp_path / "qwen3-moe-4")
    out = tmp_path / "tp4.json"
    tp = run_worker(out, str(out), str(tmp_path / "qwen3-moe-4"), nproc=4)[str(tmp_path / "qwen3-moe-4")]
    one = workload(Engine(load_model(tmp_path / "qwen3-moe-4", device="cpu", dtype="fp32").model, None,
                          EngineConfig(**CONFIG)))
    assert tp["world"] == 4 and tp["kv_shape_here"][0] == 1
    assert tp["greedy"] == one["greedy"] and tp["forks"] == one["forks"]
    for a, b in zip(tp["greedy_logprobs"], one["greedy_logprobs"]):
        assert a == pytest.approx(b, abs=LOGPROB_TOL)
    assert tp["score"] == pytest.approx(one["score"], abs=LOGPROB_TOL)


def test_a_crowded_cache_under_tensor_parallel_gives_one_process_tokens_with_only_new_blocks_sent(checkpoints,
                                                                                                  tmp_path):
    """--tp 2 with a KV cache of 12 blocks of 4 tokens a rank: sequences cross many block boundaries, are
    preempted and recomputed, fork, and adopt a twin's cached blocks, each a change the block tables'
    mirrors must follow (engine/tp.TableMirror); the tokens are one process's at the same number of
    blocks, the steps carried far fewer block ids than their runs' tables hold, and the follower's
    mirror ended equal to the leader's."""
    out = tmp_path / "crowded.json"
    tp = run_worker(out, "--crowded", str(out), str(checkpoints["llama"]))
    model = load_model(checkpoints["llama"], device="cpu", dtype="fp32").model
    one = crowded_workload(Engine(model, None, EngineConfig(**crowded(model, 1))))
    assert tp["preemptions"] > 0 and one["preemptions"] > 0
    assert tp["tokens"] == one["tokens"] and tp["forks"] == one["forks"]
    assert tp["mirrors_equal"] and tp["mirror_size"] > 0
    assert 0 < tp["sent"] < tp["whole"] / 2, (tp["sent"], tp["whole"])


def test_the_leader_stops_with_one_line_when_a_follower_is_gone(checkpoints, tmp_path):
    """...and then ends as the product does, and exits normally: with no gloo thread left, nothing can
    abort or hang at the interpreter's exit (run_worker checks the launch's exit status)."""
    out = tmp_path / "quit.json"
    got = run_worker(out, "--follower-quits", str(out), str(checkpoints["llama"]))
    said = got["said"]
    assert said.startswith("rank 0 (tensor-parallel group [0, 1]): a rank of the tensor-parallel group stopped (")
    assert "\n" not in said
    assert got["gloo_threads"] > 0 and got["gloo_threads_left"] == 0


@pytest.mark.parametrize("lose", ["none", "follower", "leader"])
def test_replicas_end_their_process_groups_before_the_interpreter_exits(tmp_path, lose):
    """4 processes, 2 replicas of TP 2: one replica works while the other has ended (its exit came early
    in a run, where a replica's leader once aborted inside gloo: "terminate called without an active
    exception"); with `lose`, the working replica's follower (or its leader, mid-run) quits. Every rank
    ends with no thread of gloo's left, so the interpreter's exit has none to race with, and the launch
    exits 0; the rank left waiting says so in one line."""
    out = tmp_path / "replicas"
    run_worker(out, "--replicas", str(out), "40", lose, nproc=4)
    ranks = {r: json.loads(Path(f"{out}.{r}").read_text()) for r in range(4) if Path(f"{out}.{r}").exists()}
    gone = {"none": [], "follower": [1], "leader": [0]}[lose]
    assert sorted(ranks) == [r for r in range(4) if r not in gone]
    for got in ranks.values():
        assert got["gloo_threads"] > 0 and got["gloo_threads_left"] == 0 and not got["pg_left"], got
    said = {r: got["said"] for r, got in ranks.items() if got["said"] is not None}
    if lose == "none":
        assert not said
    elif lose == "follower":
        assert list(said) == [0] and said[0].startswith("rank 0 (tensor-parallel group [0, 1]): a rank of the ")
    else:  # the follower waits on the leader's next step header
        assert list(said) == [1] and said[1].startswith("rank 1 (tensor-parallel group [0, 1]): its leader (rank 0) "
                                                        "stopped sending steps (") and "\n" not in said[1]


def test_replicas_of_tp_groups_start_and_end_again_and_again(tiny):
    """`torchrun --nproc-per-node 4 -m svrmad_local run --tp 2`, several launches in a row
    (SVRMAD_TP_LAUNCHES, default 2; 20 to repeat the stress run): every launch completes, with every
    question once, and no process aborts."""
    ck, data, root = tiny
    for i in range(int(os.environ.get("SVRMAD_TP_LAUNCHES", "2"))):
        out = root / f"again-{i}"
        printed = finish(launch("torchrun", "run", "--model", str(ck), "--dataset", str(data), "--out", str(out),
                                "--tp", "2", *RUN, nproc=4))
        assert "terminate called" not in printed and "Traceback" not in printed, printed[-3000:]
        assert outcome(out) == outcome(root / "single")


def random_step(rng: random.Random):
    """A StepInput as the runner makes one, at random sizes: decode runs (one new token) then prefill runs,
    block lists covering each run's context (up to thousands of blocks), copies (often none), keys or None."""
    n_runs = rng.choice([0, 1, 2, rng.randint(3, 70)])
    num_decode = rng.randint(0, n_runs)
    ids, runs = [], []
    for i in range(n_runs):
        end = rng.choice([1, rng.randint(1, 64), rng.randint(1, 40_000)])
        start = end - 1 if i < num_decode else max(0, end - rng.randint(1, 600))  # a prefill chunk
        ids += [rng.randrange(2**17) for _ in range(end - start)]
        runs.append((start, end, [rng.randrange(2**40) for _ in range(-(-end // rng.choice([1, 4, 16])))]))
    copies = [tuple(rng.randrange(2**31) for _ in range(3)) for _ in range(rng.choice([0, 0, 1, rng.randint(2, 9)]))]
    keys = None if rng.random() < 0.2 else [(rng.randrange(2**62), rng.randrange(2**20)) for _ in range(n_runs)]
    return StepInput(ids, runs, num_decode, copies, keys)


def test_a_step_crosses_the_wire_as_two_int64_tensors_and_comes_back_equal():
    """What the leader broadcasts each step (engine/tp.pack): a fixed header and one int64 payload, for
    steps of no runs, many runs, long block tables, no copies, keys or none; the stop (None) is a header
    alone. A header that does not match its payload is refused, not read."""
    rng = random.Random(0)
    steps = [None, StepInput([], [], 0, []), StepInput([5], [(0, 1, [7])], 1, [(1, 2, 3)], None)]
    steps += [random_step(rng) for _ in range(300)]
    steps.append(StepInput([0, 0], [(4, 5, [1, 2]), (8, 9, [3, 4, 5])], 2, [], [(7, 0), (8, 1)], fed=True))
    for step in steps:
        header, payload = pack(step)
        assert header.shape == (HEADER,) and header.dtype == payload.dtype == torch.long and payload.dim() == 1
        assert unpack(header, payload) == step
    assert pack(None)[1].numel() == 0
    assert unpack(*pack(steps[-1])).fed and not unpack(*pack(steps[2])).fed  # ids taken from the leader's device
    header, payload = pack(steps[2])
    with pytest.raises(ValueError, match="does not match its 9 values"):
        unpack(header, payload[:-1])


class Steps:
    """Steps as the scheduler makes them, over sequences that prefill in chunks, decode, append a block
    every `bs` tokens, change their blocks other than by an append (a block adopted from the prefix cache,
    a preemption that frees them all, a fork's child taking its parent's full blocks: each a new epoch),
    finish for good, or sit out a step; with copies now and then, and some steps empty or without keys."""

    def __init__(self, seed: int, bs: int = 4):
        self.rng, self.bs = random.Random(seed), bs
        self.uids, self.ids = itertools.count(7), itertools.count(1000)
        self.live: dict[int, dict] = {}  # uid: {"epoch", "blocks" (all it holds), "end" (computed), "len"}

    def new(self, blocks=(), length=None) -> dict:
        seq = {"epoch": 0, "blocks": list(blocks), "end": 0, "len": length or self.rng.randint(1, 40)}
        self.live[next(self.uids)] = seq
        return seq

    def step(self) -> StepInput:
        rng, bs = self.rng, self.bs
        if rng.random() < 0.05:
            return StepInput([], [], 0, [])
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            self.new()
        for uid, seq in list(self.live.items()):
            r = rng.random()
            if r < 0.04:  # finished: its uid never comes back
                del self.live[uid]
            elif r < 0.07 and seq["blocks"]:  # an identical cached block adopted
                seq["blocks"][rng.randrange(len(seq["blocks"]))] = next(self.ids)
                seq["epoch"] += 1
            elif r < 0.09:  # preempted: its blocks go back, recomputed from its first token
                seq.update(blocks=[], end=0, epoch=seq["epoch"] + 1)
            elif r < 0.11 and seq["end"] >= bs:  # a fork: the child starts from the full blocks
                full = seq["end"] // bs
                child = self.new(seq["blocks"][:full], seq["len"])
                child.update(end=full * bs, epoch=1)
        decode, prefill = [], []
        for uid, seq in self.live.items():
            if rng.random() < 0.1:  # not in this step (the token budget went to others)
                continue
            start = seq["end"]
            end = start + 1 if start >= seq["len"] else min(seq["len"], start + rng.randint(1, 12))
            seq["len"] = max(seq["len"], end)
            while len(seq["blocks"]) * bs < end + rng.choice([0, 0, bs]):  # reserved as needed, or ahead
                seq["blocks"].append(next(self.ids))
            seq["end"] = end
            (decode if end - start == 1 else prefill).append((uid, seq, start, end))
        work = decode + prefill
        runs = [(start, end, seq["blocks"][: -(-end // bs)]) for _, seq, start, end in work]
        keys = None if rng.random() < 0.1 else [(uid, seq["epoch"]) for uid, seq, _, _ in work]
        copies = [(next(self.ids), next(self.ids), rng.randint(1, bs)) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
        return StepInput([rng.randrange(400) for _, _, s, e in work for _ in range(s, e)], runs, len(decode), copies,
                         keys)


def test_a_run_of_steps_sends_each_block_once_and_the_follower_rebuilds_every_step_exactly():
    """The leader's channel and a follower's, step after step (engine/tp.TableMirror at each end): the
    follower's StepInput equals the leader's every step, through appends, epoch changes, new and finished
    sequences, evictions from a small mirror, copies, steps without keys and empty steps; the two mirrors
    stay equal (the same uids in the same order); a block crosses again only where its sequence's epoch
    changed or its uid was evicted."""
    for seed, capacity in [(0, 1024), (1, 6), (2, 1)]:
        steps, leader, follower = Steps(seed), TableMirror(capacity), TableMirror(capacity)
        sent = whole = returned = 0
        seen = set()
        for _ in range(400):
            step = steps.step()
            for key in step.keys or ():
                returned += key in seen and key[0] not in leader.tables  # evicted, and back in the same epoch
                seen.add(key)
            header, payload = pack(step, leader)
            assert unpack(header, payload, follower) == step
            assert list(follower.tables.items()) == list(leader.tables.items())
            assert len(leader.tables) <= capacity
            sent += int(header[6])
            whole += sum(len(b) for _, _, b in step.runs)
        assert pack(None, leader)[1].numel() == 0 and unpack(*pack(None, leader), follower) is None
        assert whole > 5000 and sent <= whole
        if capacity == 1024:  # every sequence kept: its blocks cross again only after a new epoch
            assert sent < whole / 4 and not returned, (seed, sent, whole)
        else:  # more sequences than the mirror keeps: some come back after their tables were evicted
            assert returned > 0, seed


def decode_step(batch: int, blocks: int, end_in_block: int, bs: int = 16) -> StepInput:
    """A decode step of `batch` sequences at `blocks` blocks of context, its token `end_in_block` of the last."""
    end = (blocks - 1) * bs + end_in_block
    runs = [(end - 1, end, list(range(i * 10**6, i * 10**6 + blocks))) for i in range(batch)]
    return StepInput(list(range(batch)), runs, batch, [], [(i, 0) for i in range(batch)])


def test_a_steady_decode_step_sends_the_same_bytes_at_any_context():
    """32 sequences decoding at 1k and at 16k blocks of context: the first step sends every table whole,
    the next (no block appended) the same few values at either context, and a step where every sequence
    appends a block one block id more each."""
    sizes = {}
    for blocks in (1024, 16384):
        leader, follower = TableMirror(), TableMirror()
        first = pack(decode_step(32, blocks, 14), leader)
        assert first[1].numel() > 32 * blocks
        assert unpack(*first, follower) == decode_step(32, blocks, 14)
        steady = pack(decode_step(32, blocks, 15), leader)
        sizes[blocks] = steady[1].numel()
        assert unpack(*steady, follower) == decode_step(32, blocks, 15)
        appended = pack(decode_step(32, blocks + 1, 1), leader)
        assert appended[1].numel() == sizes[blocks] + 32
        assert unpack(*appended, follower) == decode_step(32, blocks + 1, 1)
        shorter = pack(decode_step(32, blocks, 2), leader)  # never made by the scheduler, but a valid step
        assert shorter[1].numel() == sizes[blocks] and unpack(*shorter, follower) == decode_step(32, blocks, 2)
    assert sizes[1024] == sizes[16384] == 32 * (1 + 5 + 2)  # an id, the run's numbers, its key


def test_the_mirrors_keep_every_sequence_an_engine_of_many_sequences_runs():
    """An engine of max_num_seqs 1,500 keeps 6,000 tables mirrored: a steady step of 1,500 sequences sends
    only its ids, numbers and keys; mirrors of a fixed 1,024 would send some tables whole every step."""
    n = 1500
    assert keep_for(64) == KEEP and keep_for(n) == 4 * n
    for keep, steady_is_small in ((keep_for(n), True), (KEEP, False)):
        leader, follower = TableMirror(keep), TableMirror(keep)
        unpack(*pack(decode_step(n, 64, 14), leader), follower)
        steady = pack(decode_step(n, 64, 15), leader)
        assert unpack(*steady, follower) == decode_step(n, 64, 15)
        assert (steady[1].numel() == n * (1 + 5 + 2)) == steady_is_small


@pytest.mark.parametrize("corrupt, said", [
    (lambda m: m.tables.pop(3), r"nothing"),
    (lambda m: m.tables.update({3: (1, m.tables[3][1])}), r"epoch 1"),
    (lambda m: m.tables.update({3: (0, m.tables[3][1][:-1])}), r"9 blocks"),
    (lambda m: m.tables.update({3: (0, m.tables[3][1][:-1] + [-5])}), r"block 9 as -5"),
])
def test_a_follower_whose_mirror_disagrees_with_its_leaders_stops_with_one_line(corrupt, said):
    """A follower's mirror that lacks what the leader's says it keeps (a bug, simulated here by changing
    it) stops the follower with one line naming the sequence, never runs a wrong table."""
    leader, follower = TableMirror(), TableMirror()
    assert unpack(*pack(decode_step(8, 10, 3), leader), follower) == decode_step(8, 10, 3)
    corrupt(follower)
    with pytest.raises(TablesDisagree, match=r"^tensor-parallel step: the leader says this rank keeps 10 blocks of "
                                             r"sequence 3 \(epoch 0\), block 9 being 3000009, and it keeps " + said +
                                             r": the two mirrors of the block tables disagree \(a bug\)$"):
        unpack(*pack(decode_step(8, 10, 4), leader), follower)


def test_world_size_not_a_multiple_of_tp_is_refused():
    with pytest.raises(ValueError, match=r"^--tp 3 needs a number of processes that is a multiple of 3 .* this launch "
                                         r"has 4$"):
        Dist(rank=0, world_size=4).check_tp(3)
    Dist(rank=0, world_size=4).check_tp(2)  # 2 replicas of 2
    Dist(rank=0, world_size=4).check_tp(4)  # 1 replica of 4


def test_two_replicas_of_tp_2_share_the_questions(tiny):
    """torchrun with 4 processes and --tp 2: 2 replicas (ranks 0-1 and 2-3), each a TP-2 engine whose
    leader takes questions from the shared counter; one run folder, every question once, the same
    answers as one process."""
    ck, data, root = tiny
    out = root / "dp-tp"
    printed = finish(launch("torchrun", "run", "--model", str(ck), "--dataset", str(data), "--out", str(out),
                            "--tp", "2", *RUN, nproc=4))
    assert "2 processes" in printed  # the data-parallel workers: one per replica
    assert outcome(out) == outcome(root / "single")
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["tp"] == 2 and [r["rank"] for r in meta["ranks"]] == [0, 1]
    assert sum(r["questions"] for r in meta["ranks"]) == N and all(r["questions"] > 0 for r in meta["ranks"])


def test_a_replica_that_dies_stops_the_run_and_a_rerun_resumes(tiny):
    """4 processes, --tp 2: the leader of replica 1 is killed mid-run. torchrun stops the others (its
    own report is its business); none of our processes adds a traceback, the committed questions stay,
    and a rerun in one process runs the rest to the single-process result."""
    ck, data, root = tiny
    out = root / "dp-tp-killed"
    argv = ["run", "--model", str(ck), "--dataset", str(data), "--out", str(out), *RUN]
    proc = launch("torchrun", *argv, "--tp", "2", nproc=4)
    kill_after_its_first_commit(proc, out / "parts" / "rank-1")
    printed, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert not re.search(r"\[rank\d\]:\s*Traceback", printed), printed[-3000:]
    saved = {r["id"] for d in [out, *sorted((out / "parts").iterdir())] for name in ("trace.jsonl", "skipped.jsonl")
             for r in read_jsonl(d / name)}
    assert 0 < len(saved) < N, "the kill came too late to test a resume"
    assert not read_jsonl(out / "errors.jsonl") and not any(read_jsonl(p / "errors.jsonl")
                                                            for p in (out / "parts").iterdir())
    assert cli.main(argv) == 0
    assert outcome(out) == outcome(root / "single")


def _published_index(path: Path) -> Reader:
    """The names and dtypes the published files hold, from the plan's own list of weights (no files):
    what the loader reads to decide which modules stay packed."""
    from svrmad_local.models.plan import config_weights, read_config
    from svrmad_local.models.quant.formats import TensorInfo

    index = {}
    for w in config_weights(read_config(path)):
        if w.fmt == "mxfp4":
            index.update({f"{w.name}{k}": TensorInfo(path, "U8", ()) for k in ("_blocks", "_scales")})
        elif w.fmt == "fp8":
            index.update({w.name: TensorInfo(path, "F8_E4M3", ()), f"{w.name}_scale_inv": TensorInfo(path, "F32", ())})
        else:
            index[w.name] = TensorInfo(path, w.fmt, ())
    reader = Reader.__new__(Reader)
    reader.index, reader.used, reader._open = index, set(), {}
    return reader


@pytest.mark.parametrize("name", ["deepseek-v3.1", "gpt-oss-120b"])
def test_plan_and_engine_agree_on_the_shipped_configs(name):
    """At the real shapes (meta tensors, nothing allocated): for each --tp, the plan refuses exactly
    what the loader refuses, and otherwise the bytes the loader gives the first and the last rank are
    the plan's weight bytes per GPU (within 1%: FP8 scale grids of split weights round per rank)."""
    from transformers import AutoConfig

    from svrmad_local.engine.tp import Group
    from svrmad_local.models.plan import PlanError
    from svrmad_local.models.quant import quant_spec
    from svrmad_local.models.shard import meta_split

    path = CONFIGS / name
    config = AutoConfig.from_pretrained(path)
    spec = quant_spec(json.loads((path / "config.json").read_text()))
    index = _published_index(path)
    agreed = []
    for tp in (3, 8, 16, 32):
        try:
            plan = make_plan(path, tp, 2**50, tp=tp)["weight_bytes_per_gpu"]
        except PlanError:
            plan = None
        held = []
        for rank in (0, tp - 1):
            try:
                model, _, _ = meta_split(config, torch.bfloat16, Group(tuple(range(tp)), rank), spec, index)
            except PlanError:
                break
            seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
            held.append(sum(t.numel() * t.element_size() for t in seen.values()))
        assert (plan is None) == (not held), f"--tp {tp}: the plan says {plan}, the loader holds {held}"
        for h in held:
            assert h == pytest.approx(plan, rel=0.01)
        agreed.append(tp if held else None)
    # 3 divides no heads; DeepSeek's dense MLP at 32 gives 576 rows a rank (4.5 FP8 blocks); GPT-OSS has 8 KV heads
    assert agreed == {"deepseek-v3.1": [None, 8, 16, None], "gpt-oss-120b": [None, 8, None, None]}[name]


def test_a_split_the_plan_cannot_make_is_refused_in_one_line_by_loader_and_plan(tmp_path):
    """The published tiny DeepSeek layout (dense MLP 100 rows, experts' 40: ragged 16x16 blocks) at
    --tp 2, and 3 experts over 2 ranks: the loader refuses before reading a weight or meeting a
    collective, and `svrmad plan` refuses the same --tp."""
    from transformers import AutoConfig

    from svrmad_local.engine.tp import Group
    from svrmad_local.models.plan import PlanError
    from svrmad_local.models.quant import quant_spec
    from svrmad_local.models.shard import Slices, meta_split

    ragged, _ = write_deepseek(tmp_path / "ragged")
    three, _ = write_deepseek(tmp_path / "three", config=deepseek_config(n_routed_experts=3, intermediate_size=96,
                                                                          moe_intermediate_size=32))
    for path, tp, loader, plan in [
        (ragged, 2, r"^--tp 2 cuts the 16x16 FP8 blocks of model\.layers\.0\.mlp\.(gate|up)_proj \(100 rows give 50 a "
                    r"rank\); use a --tp that keeps 100 / tp a multiple of 16$", r"gives 50 per rank, which cuts"),
        (three, 2, r"^--tp 2 does not divide the 3 experts of model\.layers\.1\.mlp\.experts \(3\); use a --tp that "
                   r"divides 3$", r"^--tp 2 does not divide the model's 3 routed experts"),
    ]:
        spec = quant_spec(json.loads((path / "config.json").read_text()))
        with pytest.raises(PlanError, match=loader):
            meta_split(AutoConfig.from_pretrained(path), torch.float32, Group(tuple(range(tp)), 0), spec, Slices(path))
        with pytest.raises(PlanError, match=plan):
            make_plan(path, tp, 2**40, tp=tp)
