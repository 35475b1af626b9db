"""Decode steps at fixed shapes over static buffers: the path a CUDA graph captures and replays.

Why: on a GPU an eager decode step is bound by the host (a 30-layer model: ~1,300 torch ops of
~10 us each for ~6 ms of GPU work). A CUDA graph records the step's kernels once and replays them
with one launch, but only if every step of that shape reads its inputs from the same addresses and
nothing in it returns to the host. So a decode-only step of B sequences runs here as a step of P >= B
rows (P one of `batch_sizes`) whose inputs are copied first into static buffers: token ids,
positions, slot mapping, context lengths and a block table of width W (a power of two of blocks,
`widths`). Padding rows decode token 0 at position 0 into a scratch block that no sequence owns and
read only it. Decode attention reads the cache in place through the block table (the paged Triton
kernel, the absorbed MLA kernel; on the CPU the compiled kernel), so a step's work does not depend on
anything but those buffers.

Modes (`EngineConfig.cuda_graphs`):
- "auto": graphs on a CUDA device when nothing rules them out, else off with one line saying why;
- "on": the same, but a reason to be off is an error;
- "static": the static-shape path run eagerly, without capture, on any device: what a graph would
  record, checkable on the CPU (tests hold it token-exact to the dynamic path);
- "off": the dynamic path only.

When the engine is built, one probe step (a padding row only) runs under `HostSyncCheck`; an op that
would wait for the GPU or bake host data into a graph (`.item`, `.tolist`, `nonzero`, a branch on a
tensor, a boolean index, a tensor built from Python values) keeps graphs off, naming the op and the
line that called it (dynamic RoPE; our packed experts' torch path, which loops over the experts some
token chose). Graphs are captured at start-up, every (P, W) of `batch_sizes` x `widths`, largest first,
each after one eager warm-up step (padding rows only; it compiles the Triton kernels), as vLLM and
SGLang do: never in the middle of serving. Their memory is counted in the KV budget: before the cache
is sized, the largest shape is captured over a provisional cache of a few blocks and what it took is
measured (`graph_memory`); the cache gets the budget less that. A shape whose capture fails (an OOM, an
op the probe could not see, such as a host copy inside a fused op) is recorded with its reason and runs
the same step eagerly; the graphs already made are kept. Mixed steps (a prefill chunk among the
decodes), steps larger than the largest size and contexts wider than the widest table run the dynamic
path.

Under tensor parallel (engine/tp.py) every rank runs the same static steps, the followers from the
steps the leader sends, and captures the same graphs with NCCL's all-reduces inside them (over gloo
they go through the host: no graphs); the ranks agree on every decision that would otherwise leave one
waiting in a collective the others never make. Only the leader's step ends with its tokens (below): the
followers' ends at the hidden states, since nobody reads their tokens and the head and the sampling
meet no collective.

A Triton kernel that fails while a graph is captured raises (kernels._backend.fall_back) instead of
falling back to its torch reference: the fallback would be recorded into the graph and the kernel turned
off for every later eager step.

The step ends with its tokens: after the body, the LM head (fp32, softcapped: `runner.logits`), the
sampling's device part (engine/sampler.py `draw`: fixed shapes, greedy rows by argmax) and the token
statistics (engine/stats.py) run inside it, and it writes one packed float64 buffer per row (token,
log-prob, entropy, top log-probs and ids: stats.pack), which the Step reads with its one `.tolist()`.
The sampling's host part (temperatures, top-k, top-p, one uniform draw per non-greedy sample from its
own stream) is loaded with the ids, staged without blocking (kernels._backend.staged). The graph holds
the default widths (sampler.SAMPLE_TOP_K, stats.STATS_TOP_K): a step whose requests ask a wider top-k
(top_k 0 or past it) or more top log-probs, or whose rows do not all sample (a one-token prefill chunk, a
fork, a scoring request), takes the step's hidden rows instead and samples after it, eagerly, with the
same ops. So does every step where the head cannot run inside it: on another device than the body, or
doing something the probe sees return to the host (`head_found`).
"""

from __future__ import annotations

import bisect
import logging
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from svrmad_local.kernels import cpu_ops
from svrmad_local.kernels._backend import staged

from . import sampler, stats, tp
from .attention import StepContext
from .kv_cache import BlockTables

log = logging.getLogger("svrmad_local")

MODES = ("auto", "on", "static", "off")

# ops whose result the host must wait for (or whose output shape depends on tensor values)
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "equal", "is_nonzero", "bincount"}
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)
_WARNINGS = str(Path(warnings.__file__).resolve())  # a CUDA sync warning passes through it (HostSyncCheck)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to max_num_seqs (itself the last)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


# The most block-table widths captured: a model of 131,072 positions in 16-token blocks would otherwise
# take 11 widths, and 11 x 11 graphs at max_num_seqs 64 are a minute of start-up. Beyond it the widths
# step by 4, 8... instead of 2 (a step then runs at most that factor wider than its longest context:
# its split-K programs past the context find nothing to read). A parameter: more widths, closer fits.
MAX_WIDTHS = 6


def widths(max_blocks: int, smallest: int = 8, most: int | None = None) -> list[int]:
    """Block-table widths: `smallest` times powers of two (of four, eight... where powers of two would
    make more than `most`, MAX_WIDTHS), the last being `max_blocks` itself (a graph per width keeps short
    contexts from paying for split-K programs over a table sized for the longest)."""
    most = MAX_WIDTHS if most is None else most
    ratio = 2
    while True:
        out, w = [], smallest
        while w < max_blocks:
            out.append(w)
            w *= ratio
        if len(out) + 1 <= most:
            return out + [max_blocks]
        ratio *= 2


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that asked for the op."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = str(Path(frame.filename).resolve()) if frame.filename and not frame.filename.startswith("<") else ""
        if f and f != _HERE and f != _WARNINGS and not f.startswith(_TORCH):
            return f"{Path(f).name}:{frame.lineno} in {frame.name}"
    return "?"


class HostSyncCheck(TorchDispatchMode):
    """Records, while active, every op that returns to the host (`syncs`: a CUDA graph cannot capture
    it) or freezes host data into the step (`frozen`: a graph would replay the values it saw at
    capture), each as "op (file:line in function)"; nothing is raised, the caller decides. On the
    CPU it sees what a GPU run would dispatch; only a copy between devices needs a GPU to be seen (one to
    the host, and a blocking one from it: both are `syncs`).

    Some waits never reach the dispatcher: `torch.tensor(values, device="cuda")` copies its values in
    C++ before its one dispatched op (first seen on an H200). Where CUDA is initialised, the check
    also turns on CUDA's sync debug mode and records each synchronizing call that no op above
    accounts for, by the line that made it."""

    SYNC_WARNING = "synchronizing CUDA operation"

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.frozen: list[str] = []
        self._saved = {}
        self._known = 0  # > 0 while an op already noted above runs (its own CUDA wait is not noted twice)
        self._cuda = None  # (saved sync debug mode, warnings context, saved showwarning) while active
        self._thread = None  # the thread that entered the check: another thread's syncs are not its own

    @property
    def found(self) -> list[str]:
        return self.syncs + self.frozen

    @staticmethod
    def _note(into: list[str], what: str) -> None:
        entry = f"{what} ({_caller()})"
        if entry not in into:
            into.append(entry)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sync = None
        if name in _SYNC_OPS:
            sync = f"aten.{name}"
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) == 1:
            sync = "aten.repeat_interleave by a tensor of counts"
        elif name in ("index", "index_put", "index_put_") and len(args) > 1 and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or ())):
            sync = f"aten.{name} by a boolean mask"
        elif name in ("_to_copy", "copy_") and _crosses_to_host(name, args, kwargs):
            sync = f"aten.{name} to the host"
        elif name in ("_to_copy", "copy_") and _blocking_upload(name, args, kwargs):
            sync = f"aten.{name} from the host, blocking (pageable memory or non_blocking=False)"
        elif name == "lift_fresh":
            self._note(self.frozen, "torch.tensor of Python values")
        if sync is None:
            return func(*args, **kwargs)
        self._note(self.syncs, sync)
        self._known += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._known -= 1

    def _on_warning(self, message, category, filename, lineno, *rest):
        # the sync debug mode and showwarning are process-wide: count only this check's thread
        if self.SYNC_WARNING in str(message) and threading.get_ident() == self._thread:
            if not self._known:
                self._note(self.syncs, "cuda: a synchronizing call (a copy from the host, blocking, or a read "
                                       "of device values)")
            return
        self._cuda[2](message, category, filename, lineno, *rest)

    def __enter__(self):
        for attr in ("tolist", "numpy"):
            original = getattr(torch.Tensor, attr)
            self._saved[attr] = torch.Tensor.__dict__.get(attr)  # None: inherited from TensorBase

            def wrapped(t, *a, _attr=attr, _original=original, **k):
                self._note(self.syncs, f"Tensor.{_attr}")
                self._known += 1
                try:
                    return _original(t, *a, **k)
                finally:
                    self._known -= 1

            setattr(torch.Tensor, attr, wrapped)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ctx = warnings.catch_warnings()
            ctx.__enter__()
            warnings.filterwarnings("always", message=f".*{self.SYNC_WARNING}")
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")  # said once a process
            self._cuda = (torch.cuda.get_sync_debug_mode(), ctx, warnings.showwarning)
            self._thread = threading.get_ident()
            warnings.showwarning = self._on_warning
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):
        if self._cuda is not None:
            mode, ctx, _ = self._cuda
            torch.cuda.set_sync_debug_mode(mode)
            ctx.__exit__(None, None, None)  # restores the filters and showwarning
            self._cuda = None
        for attr, own in self._saved.items():
            if own is None:
                delattr(torch.Tensor, attr)
            else:
                setattr(torch.Tensor, attr, own)
        self._saved = {}
        return super().__exit__(*exc)


def watch_steps(engine) -> list[HostSyncCheck]:
    """Runs each of the engine's forwards (`runner.execute`) and samplings (`engine.stepper._sample`) under its own
    HostSyncCheck from now on; returns the list the checks are appended to (tests, the GPU check)."""
    checks: list[HostSyncCheck] = []
    for obj, attr in ((engine.runner, "execute"), (engine.stepper, "_sample")):
        def checked(*a, _f=getattr(obj, attr), **k):
            with HostSyncCheck() as check:
                out = _f(*a, **k)
            checks.append(check)
            return out
        setattr(obj, attr, checked)
    return checks


def waits(check: HostSyncCheck) -> list[str]:
    """A watched call's syncs but the one read a step makes on purpose: its sampled tokens and their
    statistics, packed in one tensor (the `.tolist()` in `_sample`)."""
    return [s for s in check.syncs if not ("Tensor.tolist" in s and "in _sample" in s)]


def _crosses_to_host(name: str, args, kwargs) -> bool:
    if name == "_to_copy":
        dev = kwargs.get("device")
        return torch.is_tensor(args[0]) and args[0].is_cuda and dev is not None and torch.device(dev).type == "cpu"
    return len(args) > 1 and torch.is_tensor(args[1]) and args[1].is_cuda and not args[0].is_cuda


def _blocking_upload(name: str, args, kwargs) -> bool:
    """A host -> CUDA copy that makes the host wait (pageable memory, or non_blocking=False): the
    blocking half of `torch.tensor(values, device="cuda")`. Only seen where CUDA is."""
    if name == "_to_copy":
        src, dev = args[0] if args else None, kwargs.get("device")
        if not (torch.is_tensor(src) and src.device.type == "cpu" and dev is not None
                and torch.device(dev).type == "cuda"):
            return False
    elif len(args) > 1 and torch.is_tensor(args[1]) and args[1].device.type == "cpu" and args[0].is_cuda:
        src = args[1]
    else:
        return False
    non_blocking = kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False)
    return not (non_blocking and src.is_pinned())


def why_off(mode: str, device, paths, spec, cache_devices, group=None) -> str | None:
    """Why the static path (mode "static") or graphs ("auto"/"on") cannot run here, or None: for a model
    whose embedding sits on `device`, attending as `paths` say, its layers' KV on `cache_devices`. Under
    tensor parallel (`group`, engine/tp.py) every rank asks with the same settings and gets the same answer."""
    if mode not in MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return "as asked"
    if mode != "static" and not can_capture(device):
        return f"{device.type}: CUDA graphs need a CUDA device"
    if mode != "static" and group is not None and not tp.graphs_record_collectives(group):
        return "tensor parallel over gloo: its all-reduces go through the host, which a CUDA graph cannot record"
    if paths.cascade:
        return "cascade attention plans its levels on the host every step"
    kinds = {s.kind for s in spec.layers}
    if "kv" in kinds and paths.inplace_decode is None:
        return "decode attention gathers the context (no in-place decode kernel: attention='sdpa' or none built)"
    if "latent" in kinds and not paths.mla_absorbed:
        return "mla='expanded' re-expands the context every step"
    devices = set(cache_devices)
    if len(devices) > 1:
        return "layers on several devices (a device map)"
    return None


@dataclass(frozen=True)
class Plan:
    """What the build's graphs choice hands the runner (engine/choices.py): the static path's largest
    batch, its widest block table, the cache block its padding rows write (no sequence owns it), and
    whether its shapes are captured as CUDA graphs (else run eagerly: cuda_graphs="static")."""

    max_num_seqs: int
    max_blocks: int
    scratch: int
    capture: bool


@dataclass
class Decoded:
    """What a static step gives the Step: the final hidden states [rows, H] and, where the step sampled
    inside (`packed`, else None), its rows' tokens and statistics as stats.pack lays them out [rows, 3 + 2k]."""

    hidden: torch.Tensor
    packed: torch.Tensor | None = None

    def rows(self, n: int) -> "Decoded":
        return Decoded(self.hidden[:n], None if self.packed is None else self.packed[:n])


class StaticDecode:
    """The static-shape decode path over one runner, with a graph per (batch size, width) captured at
    start-up by `capture_all` where `capture` (CUDA), else run eagerly. `scratch` is a block of the
    cache no sequence owns. Built, it runs one probe step (a padding row only: it writes the scratch
    block) under `HostSyncCheck`; `found` lists what would keep a graph from capturing the step's body,
    `head_found` what keeps the LM head and the sampling out of it (the step then ends at the hidden states),
    as it would be on the leader; a tensor-parallel follower (`leads` False) never samples inside."""

    def __init__(self, runner, max_num_seqs: int, max_blocks: int, scratch: int, capture: bool):
        self.runner, self.scratch, self.capture = runner, scratch, capture
        self.sizes, self.widths = batch_sizes(max_num_seqs), widths(max_blocks)
        n, dev = self.sizes[-1], runner.device
        self.inputs = torch.zeros(3, n, dtype=torch.long, device=dev)  # ids, positions, slots
        self.inputs[2] = scratch * runner.block_size
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)  # context lengths (the kernels take int32)
        self.tables = {w: torch.full((n, w), scratch, dtype=torch.int32, device=dev) for w in self.widths}
        vocab = runner.lm_head.out_features
        self.K, self.topk = min(sampler.SAMPLE_TOP_K, vocab), min(stats.STATS_TOP_K, vocab)  # the widths it holds
        # the sampling's host part (sampler.Draws.table), the padding rows' (greedy: they draw nothing) to start
        self.draws = torch.from_numpy(self._padding_draws(n)).to(dev)
        self.sampling = False  # whether the step samples inside (decided by the probe below)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failed: dict[tuple[int, int], str] = {}  # shapes whose capture failed: they run eagerly
        self.pool = None
        self.pool_bytes = 0  # device memory the captures took (measured around them)
        self.replays = 0
        self.group = tp.group_of(runner.model)  # tensor parallel: every rank runs every static step
        with torch.inference_mode(), HostSyncCheck() as check:
            hidden = self._body(1, self.widths[0])
        self.found = check.found
        self.head_found = self._probe_head(hidden)
        # a follower's tokens would never be read (only the leader's are: the LM head is whole on every rank
        # and the sampling meets no collective), so its step ends at the hidden states and its graphs leave
        # out a read of the head's weight a step; what runs in step across the ranks (the body) is the same
        self.leads = self.group is None or self.group.rank == 0
        self.sampling = self.leads and not self.head_found
        if self.group is not None:  # all ranks capture, or none: a capture's warm-up step meets in collectives
            others = [r for r in tp.ranks_where([self.found], dev, self.group)[0] if r != self.group.rank]
            if others and not self.found:
                self.found = [f"the probe step of tensor-parallel rank {others[0]} returns to the host"]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (P, W) the path runs at, largest first (the order of capture: smaller steps then reuse
        the memory pool's blocks that the larger ones freed)."""
        return sorted(((p, w) for p in self.sizes for w in self.widths), key=lambda s: (-s[0] * s[1], -s[0]))

    def shape(self, step) -> tuple[int, int] | None:
        """(P rows, W table columns) a decode-only step runs at, or None where it runs the dynamic path."""
        B = step.num_decode
        if B != len(step.runs) or not 0 < B <= self.sizes[-1]:
            return None
        widest = max(len(b) for _, _, b in step.runs)
        if widest > self.widths[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, B)], self.widths[bisect.bisect_left(self.widths, widest)]

    def _probe_head(self, hidden: torch.Tensor) -> list[str]:
        """Why the LM head and the sampling cannot run inside the step (empty: they can): a head on another
        device than the body, or what the probe step's head and sampling (the padding row) do that returns
        to the host."""
        head = self.runner.lm_head.weight.device
        if head != torch.device(self.runner.device):
            return [f"the LM head is on {head}, the body on {self.runner.device}"]
        with torch.inference_mode(), HostSyncCheck() as check:
            self._decide(hidden, 1)
        return check.found

    def fits(self, widths: tuple[int, int]) -> bool:
        """Whether the step can sample inside rows whose sampling has these widths ((K, topk): sampler.widths,
        a Draws' K and topk): the widths it holds, the head inside."""
        return self.sampling and widths == (self.K, self.topk)

    def run(self, step, shape: tuple[int, int], draws=None, fed=None) -> Decoded:
        """A decode-only step (rows in the step's order) at `shape`: the shape's graph replayed, or (no
        graph: not captured, or its capture failed) run eagerly. Its hidden states [B, H], and its rows'
        tokens and statistics where `draws` (the sampling's host part) fits the step (`fits`), else None.
        `fed`: (packed, rows) where the step's token ids are still on the device, row i's in the previous
        step's packed rows at rows[i] (EngineConfig.overlap: step.ids hold placeholders, `step.fed`); under
        tensor parallel the followers, given none, take the leader's."""
        B, (P, W) = step.num_decode, shape
        fits = draws is not None and self.fits((draws.K, draws.topk))
        self._load(step, P, W, draws if fits else None, fed)
        hit = self.graphs.get((P, W))
        if hit is not None:
            hit[0].replay()
            self.replays += 1
            out = hit[1]
        else:  # run eagerly: the head and the sampling only where they are wanted (a graph runs them always)
            out = self._forward(P, W) if fits else Decoded(self._body(P, W))
        out = out.rows(B)
        return out if fits else Decoded(out.hidden)

    @torch.inference_mode()
    def capture_all(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """Captures `shapes` (default: every shape), before any request is served: each after one eager
        warm-up step (padding rows only: they write the scratch block; it compiles the Triton kernels).
        A shape whose capture fails is recorded in `failed` with the reason and runs eagerly; the graphs
        already made are kept, and the others are still tried. `pool_bytes`: what the captures took."""
        before = device_bytes(self.runner.device)
        shapes = self.shapes if shapes is None else shapes
        if self.group is not None:
            tp.ready_for_capture(self.runner.device, self.group)
        for P, W in shapes:
            self._forward(P, W)
            self._capture(P, W)
        if self.group is not None:
            self._agree_on_failures(shapes)
        self.pool_bytes = device_bytes(self.runner.device) - before
        if self.failed:
            (P, W), why = next(iter(self.failed.items()))
            log.warning("svrmad: %d of %d decode shapes not captured (they run eagerly); batch %d, width %d: %s",
                        len(self.failed), len(self.failed) + len(self.graphs), P, W, why)

    def _agree_on_failures(self, shapes) -> None:
        """Under tensor parallel, a shape whose capture failed on any rank runs eagerly on every rank, so
        that every rank runs every step the same way (and says so alike): its graph, where made, is dropped."""
        failed = tp.ranks_where([s in self.failed for s in shapes], self.runner.device, self.group)
        for (P, W), ranks in zip(shapes, failed):
            if ranks and (P, W) not in self.failed:
                del self.graphs[(P, W)]
                self.failed[(P, W)] = f"its capture failed on tensor-parallel rank {ranks[0]}"

    def _load(self, step, P: int, W: int, draws=None, fed=None) -> None:
        """Copies the step into the static buffers: ids, positions and slots and lengths from host arrays
        (numpy, staged without blocking: a few calls at any batch size), and the sampling's host part
        (`draws`, sampler.Draws, where the step samples inside); the block table's rows from the
        runner's device copy (appended to, kv_cache.DeviceTables), the padding rows' reading the scratch
        block: the host work does not grow with the context. Ids `fed` ((packed, rows): see `run`) are
        gathered on the device from the previous step's packed rows, queued behind it: the host never
        waits for them."""
        bs, B, dev = self.runner.block_size, step.num_decode, self.runner.device
        host = np.zeros((3, P), dtype=np.int64)
        host[2] = self.scratch * bs
        lens = np.ones(P, dtype=np.int32)
        host[0, :B] = step.ids
        for i, (_, end, blocks) in enumerate(step.runs):
            host[1, i], lens[i] = end - 1, end
            host[2, i] = blocks[(end - 1) // bs] * bs + (end - 1) % bs
        self.inputs[:, :P].copy_(staged(torch.from_numpy(host), torch.long, dev))
        if fed is not None:
            packed, rows = fed
            self.inputs[0, :B].copy_(packed.index_select(0, staged(rows, torch.long, dev))[:, 0].long())
        if step.fed and self.group is not None:  # every rank decodes the leader's tokens
            tp.take_leaders(self.inputs[0, :B], self.group)
        self.lens[:P].copy_(staged(torch.from_numpy(lens), torch.int32, dev))
        rows = self.runner.decode_tables(step).block_table
        self.tables[W][:B, : rows.shape[1]].copy_(rows)
        self.tables[W][B:P].fill_(self.scratch)
        if draws is not None:
            table = np.empty((5, P), dtype=np.float64)
            table[:, :B] = draws.table
            table[:, B:] = self._padding_draws(P - B)
            self.draws[:, :P].copy_(staged(torch.from_numpy(table), torch.float64, dev))

    def _padding_draws(self, n: int) -> np.ndarray:
        """The sampling table of `n` padding rows: greedy (temperature 1, nothing masked, no draw)."""
        return np.repeat(np.array([[1.0], [self.K], [1.0], [0.0], [1.0]]), n, axis=1)

    def _forward(self, P: int, W: int) -> Decoded:
        """The step of shape (P, W) over the static buffers (what a graph captures): the body and, where
        the step samples inside, the head, the sampling and the statistics."""
        hidden = self._body(P, W)
        return Decoded(hidden, self._decide(hidden, P) if self.sampling else None)

    def _decide(self, hidden: torch.Tensor, P: int) -> torch.Tensor:
        """The rows' tokens and statistics, packed (stats.pack): the head's fp32 logits, sampled from the
        loaded draws at the widths the step holds."""
        logits, impl = self.runner.logits(hidden), self.runner.paths.kernel_impl
        if cpu_ops.samples(logits):  # on the CPU, where nothing is captured: the same ops in one compiled call
            return cpu_ops.sample_pack(logits, self.draws[:, :P], self.K, self.topk)
        if sampler.fuses(logits, self.K, self.topk, impl, self.runner.sampling):  # on a GPU: two Triton kernels
            out = sampler.fused(logits, self.draws[:, :P], self.K, self.topk, impl)
            if out is not None:
                return out
        return sampler.packed_by_torch(logits, self.draws[:, :P], self.K, self.topk)

    def _body(self, P: int, W: int) -> torch.Tensor:
        """The model body over the static buffers: final hidden states [P, H]."""
        r = self.runner
        ids, pos, slots = self.inputs[0, :P], self.inputs[1, :P], self.inputs[2, :P]
        ctx = StepContext(r.cache, r.spec.layers, slots, [], P, r.static_paths,
                          decode_tables=BlockTables(self.tables[W][:P], self.lens[:P]))
        if r.spec.has_latent:
            ctx.latent_runs = []
        return r.run_body(ctx, ids.unsqueeze(0), pos.unsqueeze(0))

    def _capture(self, P: int, W: int) -> None:
        """Records the step of shape (P, W) into a graph sharing one memory pool with the others; a
        failure is recorded in `failed` (first line of the error, with its type)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the event loop's thread may touch CUDA (a future's tensor) while this one captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(P, W)
        except Exception as err:
            self.failed[(P, W)] = f"{type(err).__name__}: {err}".splitlines()[0]
            return
        self.graphs[(P, W)] = (graph, out)


PROVISIONAL_BLOCKS = 3  # the cache the graphs' memory is measured over, before the real one is sized


@torch.inference_mode()
def graph_memory(runner, max_num_seqs: int, max_blocks: int) -> tuple[int, list[str]]:
    """Bytes to keep out of the KV budget for the decode graphs, measured before the KV cache is sized,
    and what the probe step saw return to the host (`StaticDecode.found`: it keeps graphs off): over the
    runner's provisional cache (PROVISIONAL_BLOCKS blocks: padding rows read and write only the scratch
    block, whatever the table's width), the largest shape is captured and what it took measured; every
    other shape adds its output rows, which each graph keeps (its intermediates reuse the shared pool).
    0 where the step cannot be captured."""
    n = runner.cache.k[0].shape[0] // runner.block_size
    probe = StaticDecode(runner, max_num_seqs, max_blocks, n - 1, capture=True)
    if probe.found:
        return 0, probe.found
    probe.capture_all(probe.shapes[:1])
    taken = probe.pool_bytes
    out = probe._forward(1, probe.widths[0])
    row = sum(t.shape[-1] * t.element_size() for t in (out.hidden, out.packed) if t is not None)
    rest = sum(p for p, _ in probe.shapes[1:]) * row
    del probe, out
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return max(0, taken) + rest, []


def device_bytes(device) -> int:
    """Memory torch's allocator holds on `device` (0 off CUDA): what a capture took, measured around it."""
    device = torch.device(device)
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def can_capture(device) -> bool:
    """Whether CUDA graphs can record steps on `device`."""
    return torch.device(device).type == "cuda"
