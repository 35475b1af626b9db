"""`--linear auto` on the CPU: choose the linear backend from this machine's measurements, once per machine.

Why: which backend is fastest depends on the CPU. On 2-core AVX2 and AVX-512 EPYCs our panels beat
oneDNN at every step size; on an AVX-512 + AMX Intel oneDNN was 1.7x faster at a 512-row prefill chunk
while the panels won at 1-8 rows (docs/measurements.md). A rule written from one machine's figures is a guess on
the next, so `auto` times the candidates here, running whole steps' linears as the forward runs them
(the model's own GEMM shapes in its order, q/k/v and gate/up fused where they are) at the step sizes
that occur, and keeps the one layout that minimises the expected
workload. One layout, because the panels and oneDNN's blocked layout are different bytes: serving
decode from one and prefill from the other would keep two copies of the weights (the 1.1x memory rule,
docs/engine.md).

The figures are cached per machine (`cache_key`: CPU model and the ISA flags that matter, threads, torch
and project version, the panel kernel's source, dtype, shapes, step sizes, candidates, how they were timed) in a small JSON under the cache dir, so only
the first engine on a machine pays the seconds. The choice itself is recomputed from the cached figures
each time, so changing the workload mix needs no new timing. SVRMAD_CALIBRATE=0 skips all of it
(`auto` then takes its fixed rule: panels, else oneDNN, else F.linear); SVRMAD_CALIBRATE=again times
again (say, after figures were taken on a busy machine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from importlib import metadata
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from svrmad_local.errors import UserError
from svrmad_local.kernels import cpu_linear
from svrmad_local.models.default import cache_dir

from .layouts import ONEDNN, PANELS, sibling_groups

log = logging.getLogger("svrmad_local")

PREFERENCE = ("panels", "onednn", "aten")  # ties and near-ties go to the earlier one (panels: same tokens everywhere)
NAMES = {"panels": "panels", "onednn": "oneDNN packed", "aten": "F.linear"}
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx_vnni")


@dataclass(frozen=True)
class Workload:
    """What the engine is expected to compute, to weigh the step sizes' timings.

    prompt_per_generated: prompt tokens computed per generated token. 5 by default: the report's run of all
    five debate methods on 4 GSM8K questions computed 186,081 prompt tokens and generated 37,227. A generated token is
    taken as equally likely to come from a decode step of any size in `decode_rows`, a prompt token from a
    prefill chunk of any size in `prefill_rows`. `margin`: the panels (the same tokens on every machine)
    are kept unless another backend's expected time is lower by more than this fraction."""

    prompt_per_generated: float = 5.0
    decode_rows: tuple[int, ...] = (1, 8, 64)
    prefill_rows: tuple[int, ...] = (64, 512)
    margin: float = 0.05

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int, **kw) -> "Workload":
        """Decode at 1 row, a mid batch and max_num_seqs; prefill chunks of 64 and 512 tokens, or the
        scheduler's token budget where it is smaller."""
        decode = sorted({1, max(1, max_num_seqs // 8), max(1, max_num_seqs)})
        prefill = sorted({min(64, max_num_batched_tokens), min(512, max_num_batched_tokens)})
        return cls(decode_rows=tuple(decode), prefill_rows=tuple(prefill), **kw)


@dataclass(frozen=True)
class Gemm:
    """One GEMM shape of a step: `count` weights of [n, k] (fused siblings as one); the LM head apart,
    since a prefill chunk runs it only on the rows whose next token is wanted (taken as 1)."""

    k: int
    n: int
    count: int
    head: bool = False


@dataclass
class Calibration:
    """What `auto` chose and the figures it chose from: `figures[kind][backend][M]` is ms of one step's
    linears (kind "decode": every linear at M rows; "prefill": the body at M rows, the head at 1),
    `cost[backend]` ms per generated token under `workload`."""

    choice: str
    reason: str
    figures: dict
    cost: dict
    workload: Workload
    cached: bool = False
    path: str | None = None
    busy: float | None = None  # others' share of the machine while it was timed (None: cached, or unknown)
    run: "RunMix | None" = None  # the engine's own steps since, weighed against these figures

    def as_dict(self) -> dict:
        """For engine.info and run.json (plain JSON types)."""
        workload = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.workload).items()}
        return {"choice": self.choice, "reason": self.reason, "figures": self.figures, "cost_ms_per_token": self.cost,
                "workload": workload, "cached": self.cached, "cache_file": self.path,
                "busy_share": None if self.busy is None else round(self.busy, 3),
                "run": self.run.as_dict() if self.run is not None else None}


class CalibrationSettingError(UserError, ValueError):
    """SVRMAD_CALIBRATE holds a value that means nothing: said in one line, before anything is timed."""


SETTINGS = {"on": ("on", "1", "true", "yes", ""), "off": ("off", "0", "false", "no"), "again": ("again",)}


def setting() -> str:
    """SVRMAD_CALIBRATE: "on" (on/1/true/yes, or unset), "off" (off/0/false/no: `auto` takes its fixed rule),
    "again" (time again and overwrite this machine's cached figures); any other value is refused."""
    v = os.environ.get("SVRMAD_CALIBRATE", "on").strip().lower()
    for name, spellings in SETTINGS.items():
        if v in spellings:
            return name
    raise CalibrationSettingError(
        f"SVRMAD_CALIBRATE={os.environ['SVRMAD_CALIBRATE']!r} means nothing: use on (1, true, yes), off (0, false, "
        "no) or again")


def enabled() -> bool:
    return setting() != "off"


def order(model: nn.Module, backend: str, fuse: bool = True) -> list[tuple[int, int, bool]]:
    """The GEMMs of one step on `backend` as the forward runs them, in its order: (k, n, is the LM head) each.
    The packed backends run sibling projections as one GEMM (select_linear fuses them, where the first
    sibling is called); F.linear runs each module alone."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    groups = sibling_groups(model, linears) if fuse and backend != "aten" else []
    first = {g[0][0]: g for g in groups}
    later = {name for g in groups for name, _ in g[1:]}
    out = []
    for name, m in linears:
        if name in first:
            out.append((m.in_features, sum(s.out_features for _, s in first[name]), False))
        elif name not in later:
            out.append((m.in_features, m.out_features, m is head))
    return out


def gemms(model: nn.Module, backend: str, fuse: bool = True) -> list[Gemm]:
    """The distinct GEMM shapes one step runs on `backend` and how often (`order`, counted)."""
    return [Gemm(k, n, c, h) for (k, n, h), c in sorted(Counter(order(model, backend, fuse)).items())]


def cpu_id() -> dict:
    """The CPU as the cache keys it: /proc/cpuinfo's model name and the flags that change the kernels."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    name, flags = info.get("model name") or platform.processor() or platform.machine(), set(info.get("flags", "").split())
    return {"model": name, "flags": [f for f in FLAGS if f in flags], "capability": torch.backends.cpu.get_cpu_capability()}


def project_version() -> str:
    try:
        return metadata.version("svrmad-local")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


TIMING = "whole steps in the forward's order"  # how the figures were taken: figures taken another way time again


def cache_key(model: nn.Module, candidates: list[str], workload: Workload, fuse: bool = True) -> dict:
    dtype = next(m.weight.dtype for m in model.modules() if type(m) is nn.Linear)
    return {"cpu": cpu_id(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "project": project_version(), "dtype": str(dtype).removeprefix("torch."),
            "decode_rows": list(workload.decode_rows), "prefill_rows": list(workload.prefill_rows),
            "gemms": {b: [asdict(g) for g in gemms(model, b, fuse)] for b in candidates},
            # the panel kernel's own code: an edit to it between releases times again
            "panel_kernel": cpu_linear.digest(), "timing": TIMING}


def cache_path(key: dict, cache: str | Path | None = None) -> Path:
    """The figures' file under the cache dir: `cache` (--cache-dir), else $SVRMAD_CACHE, else ~/.cache/svrmad-local."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(cache) / "calibration" / f"linear-{digest}.json"


BUSY = 0.10  # others' share of the machine's CPU time over the timing above which the figures are not kept


class OtherLoad:
    """How much of this machine's CPU time other processes took over a window: from /proc/stat (every CPU's
    busy time, the hypervisor's steal included) less this process's own (every thread's). Figures timed
    while others ran are slower than the backends are, and by how much depends on which backend the
    neighbours' bursts met; so they are used for this run but not cached (`share` is None off Linux)."""

    def __init__(self):
        self._start = self._read()

    @staticmethod
    def _read():
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # all but idle, iowait
            hz = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
        own = os.times()
        return busy / hz, own.user + own.system, time.monotonic()

    def share(self) -> float | None:
        """Others' CPU seconds over the window, as a fraction of the machine's (wall x CPUs)."""
        end = self._read()
        if self._start is None or end is None:
            return None
        (busy0, own0, t0), (busy1, own1, t1) = self._start, end
        wall = max(t1 - t0, 1e-6) * (os.cpu_count() or 1)
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall)


def l3_bytes() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip().upper()
        return int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
    except (OSError, ValueError, IndexError):
        return 32 << 20


LAYOUTS = {"panels": PANELS, "onednn": ONEDNN}  # the packed backends' layouts; F.linear ("aten") reads the dense weight


def _mm(backend: str, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    layout = LAYOUTS.get(backend)
    return layout.mm(x, w, None, n) if layout else torch.nn.functional.linear(x, w)


def time_step(plans: dict[str, list[tuple[int, int, bool]]], decode_rows: tuple[int, ...],
              prefill_rows: tuple[int, ...], budget_s: float, dtype: torch.dtype = torch.float32,
              stream_bytes: int | None = None, mm: Callable = _mm,
              clock: Callable[[], float] = time.perf_counter) -> dict[tuple[str, str, int], float]:
    """ms of one step's linears on each backend of `plans` (its GEMMs in the forward's order, `order`), at
    each decode size (every GEMM at M rows) and prefill chunk (the body at M rows, the head at 1).

    What a step runs is what is timed: a pass is one call of every GEMM of the step in the forward's
    order, each call on its own weight (the model's number of them, together at most `stream_bytes`, at
    least twice the L3 cache, a backend; beyond that the weights are taken again in turn), so the weights
    stream from memory and the shapes alternate as in a step; a pass's figure is the sum of its calls.
    (Timing each call alone and keeping its fastest once read F.linear at half of what it took in the
    engine's steps on an AMX Intel Xeon: MKL's calls at decode sizes vary by 1.5-3x between calls, the
    panels' far less.) The backends take turns, a pass each (a neighbour's burst of work slows all of
    them, not one), within each size's share of `budget_s`; a backend's figure is its fastest pass (a
    pass that waited for a core on a shared machine is longer by a scheduler slice). A pass longer than
    its share goes on with only the shapes it has not yet called, and counts each shape at the mean of
    its calls (a 512-row chunk of a large model would take seconds a pass). Before a size is timed each
    backend calls each shape once (oneDNN builds its primitive for a new M). Scratch: random weights and
    each backend's packed copy of them, freed on return. `mm` and `clock` are what the tests replace."""
    stream_bytes = stream_bytes or max(64 << 20, 2 * l3_bytes())
    size = torch.empty((), dtype=dtype).element_size()
    copies: dict[tuple[int, int], int] = {}
    for plan in plans.values():
        scale = min(1.0, stream_bytes / (size * sum(k * n for k, n, _ in plan)))
        for (k, n), c in Counter((k, n) for k, n, _ in plan).items():
            copies[k, n] = max(copies.get((k, n), 1), math.ceil(c * scale))
    layouts = {b: LAYOUTS.get(b) for b in plans}
    pools: dict[str, dict[tuple[int, int], list[torch.Tensor]]] = {b: {} for b in plans}
    for (k, n), c in copies.items():  # a shape's dense weights kept only where F.linear reads them
        dense = [torch.randn(n, k).to(dtype) for _ in range(c)]
        for b, plan in plans.items():
            if any((k2, n2) == (k, n) for k2, n2, _ in plan):
                pools[b][k, n] = [layouts[b].pack(d) for d in dense] if layouts[b] else dense
        del dense
    calls = {}
    for b, plan in plans.items():
        seen: Counter = Counter()
        calls[b] = []
        for k, n, head in plan:
            pool = pools[b][k, n]
            calls[b].append(((k, n, head), pool[seen[k, n] % len(pool)]))
            seen[k, n] += 1
    kinds = [("decode", m) for m in decode_rows] + [("prefill", m) for m in prefill_rows]
    slice_s = budget_s / max(1, len(kinds))
    cap = slice_s / (2 * len(plans))

    def one_pass(b: str, xs: dict) -> float:
        spent: Counter = Counter()
        done: Counter = Counter()
        t_pass = clock()
        for key, w in calls[b]:
            if key in done and clock() - t_pass > cap:
                continue
            x = xs[key[0], key[2]]
            t0 = clock()
            mm(b, x, w, key[1])
            spent[key] += clock() - t0
            done[key] += 1
        return sum(c * spent[key] / done[key] for key, c in Counter(key for key, _ in calls[b]).items())

    out = {}
    ks = {k for plan in plans.values() for k, _, _ in plan}
    with torch.inference_mode():
        for kind, m in kinds:
            xs = {(k, head): torch.randn(1 if head and kind == "prefill" else m, k).to(dtype)
                  for k in ks for head in (False, True)}
            for b in plans:
                for key, w in dict(calls[b]).items():
                    mm(b, xs[key[0], key[2]], w, key[1])
            best, t_end = dict.fromkeys(plans, float("inf")), clock() + slice_s
            for r in range(20):
                for b in plans:
                    best[b] = min(best[b], one_pass(b, xs))
                if clock() > t_end:
                    break
            out.update({(b, kind, m): v * 1e3 for b, v in best.items()})
    return out


def measure(model: nn.Module, candidates: list[str], workload: Workload, fuse: bool = True, budget_s: float = 3.0,
            timer: Callable | None = None) -> dict:
    """figures[kind][backend][M]: ms of one step's linears, from `timer(plans, decode_rows, prefill_rows,
    budget_s, dtype)` (`time_step`'s interface: ms of a step per (backend, kind, M), each backend's
    GEMMs given in the forward's order)."""
    timer = timer or time_step
    dtype = next(m.weight.dtype for m in model.modules() if type(m) is nn.Linear)
    plans = {b: order(model, b, fuse) for b in candidates}
    ms = timer(plans, workload.decode_rows, workload.prefill_rows, budget_s, dtype)
    figures = {}
    for kind, sizes in (("decode", workload.decode_rows), ("prefill", workload.prefill_rows)):
        steps = monotone({(b, m): ms[b, kind, m] for b in candidates for m in sizes})
        figures[kind] = {b: {str(m): round(steps[b, m], 3) for m in sizes} for b in candidates}
    return figures


def monotone(per_step: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """A step with fewer rows streams the same weights and does less arithmetic, so it costs no more than
    one with more: a figure above a larger M's (passes that waited for a core throughout their window on a
    busy machine) is lowered to it."""
    out = dict(per_step)
    for (b, m), v in per_step.items():
        out[b, m] = min([v] + [w for (b2, m2), w in per_step.items() if b2 == b and m2 > m])
    return out


def choose(figures: dict, workload: Workload) -> tuple[str, dict]:
    """The backend whose expected ms per generated token is lowest (decode ms/token averaged over the
    decode sizes, plus prompt_per_generated x prefill ms/token averaged over the chunk sizes); the panels
    are kept unless another backend is lower by more than workload.margin. Returns (choice, cost)."""
    backends = [b for b in PREFERENCE if b in figures["decode"]]

    def per_token(kind, b):
        table = figures[kind][b]
        return sum(v / int(m) for m, v in table.items()) / len(table)

    cost = {b: round(per_token("decode", b) + workload.prompt_per_generated * per_token("prefill", b), 4)
            for b in backends}
    best = min(backends, key=lambda b: (cost[b], backends.index(b)))
    if "panels" in cost and best != "panels" and cost[best] > cost["panels"] * (1 - workload.margin):
        best = "panels"
    return best, cost


def step_ms(figures: dict, backend: str, kind: str, rows: int) -> float:
    """ms of one step of `rows` rows on `backend`, from the figures of `kind` ("decode": every linear at that
    many rows; "prefill": the body at that many rows, the head at one): linear between the sizes measured,
    the largest size's cost a row beyond it, the smallest's figure below it (fewer rows cost no less)."""
    table = sorted((int(m), v) for m, v in figures[kind][backend].items())
    if rows <= table[0][0]:
        return table[0][1]
    for (m0, v0), (m1, v1) in zip(table, table[1:]):
        if rows <= m1:
            return v0 + (v1 - v0) * (rows - m0) / (m1 - m0)
    m, v = table[-1]
    return v * rows / m


RECHECK = (32, 128, 512, 2048, 8192)  # steps after which the run's own mix is weighed again


class RunMix:
    """The run's own steps, to weigh the figures by: how many steps of each kind and row count the engine
    ran (a step with prompt rows is a prefill step: its linears run the body on all rows, the head on
    the few that sample). At the steps of RECHECK, `better` says which backend the mix so far wants, where
    it is not the one in place: the choice made at build from the Workload's fixed mix holds for the
    run at hand only as long as the run's own steps agree with it."""

    def __init__(self, cal: Calibration, current: str, margin: float | None = None):
        self.cal, self.current = cal, current
        self.margin = cal.workload.margin if margin is None else margin
        self.counts: Counter = Counter()
        self.steps = 0
        self.switches: list[dict] = []

    def add(self, prompt_rows: int, decode_rows: int) -> None:
        rows = prompt_rows + decode_rows
        if rows > 0:
            self.counts["prefill" if prompt_rows else "decode", rows] += 1
            self.steps += 1

    def cost(self) -> dict[str, float]:
        """ms of linears the run's steps so far took, or would have, on each backend timed."""
        return {b: round(sum(n * step_ms(self.cal.figures, b, kind, rows) for (kind, rows), n in self.counts.items()), 3)
                for b in self.cal.figures["decode"]}

    def better(self) -> str | None:
        """At a RECHECK step: the backend the run's mix wants if it is not the current one and is faster by more
        than the margin over the steps so far; else None."""
        if self.steps not in RECHECK or not self.cal.figures:
            return None
        cost = self.cost()
        best = min(cost, key=lambda b: (cost[b], PREFERENCE.index(b)))
        return best if best != self.current and cost[best] < cost[self.current] * (1 - self.margin) else None

    def as_dict(self) -> dict:
        kinds = {k: sum(n for (kind, _), n in self.counts.items() if kind == k) for k in ("decode", "prefill")}
        rows = {k: sum(n * r for (kind, r), n in self.counts.items() if kind == k) for k in ("decode", "prefill")}
        return {"steps": self.steps, "decode_steps": kinds["decode"], "prefill_steps": kinds["prefill"],
                "decode_rows": rows["decode"], "prefill_rows": rows["prefill"],
                "cost_ms": self.cost() if self.cal.figures else {}, "switches": self.switches}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a figure")  # json reads NaN and Infinity unless told not to


def finite_figures(figures: dict, key: dict) -> None:
    """Raises ValueError unless `figures` holds one finite positive number per backend, kind and step size."""
    for kind in ("decode", "prefill"):
        for b in key["gemms"]:
            table = figures[kind][b]
            if set(table) != {str(m) for m in key[f"{kind}_rows"]} or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                    for v in table.values()):
                raise ValueError(f"the {kind} figures of {b} are not one finite positive number a step size")


def _read(path: Path, key: dict) -> dict | None:
    """The cached figures for `key`, or None (absent, another key); an unreadable file is said in one line."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
        if data.get("key") != key:
            return None
        figures = data["figures"]
        finite_figures(figures, key)
        return figures
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("svrmad: ignoring the unreadable linear calibration %s (%s: %s); timing again", path,
                    type(e).__name__, e)
        return None


def _write(path: Path, key: dict, figures: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "figures": figures}, indent=1, sort_keys=True, allow_nan=False))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("svrmad: could not save the linear calibration to %s (%s); the next engine times again", path, e)


def calibrate(model: nn.Module, candidates: list[str], workload: Workload | None = None, fuse: bool = True,
              budget_s: float = 3.0, timer: Callable | None = None, cache: str | Path | None = None) -> Calibration:
    """Time `candidates` on `model`'s shapes (or read this machine's cached figures under `cache`, the
    --cache-dir, else the default cache dir) and choose one. Figures timed while other processes took more
    than BUSY of the machine are used for this choice but not cached, and the reason says so."""
    workload = workload or Workload()
    candidates = [b for b in PREFERENCE if b in candidates]
    key = cache_key(model, candidates, workload, fuse)
    path = cache_path(key, cache)
    figures = None if setting() == "again" else _read(path, key)
    cached, busy = figures is not None, None
    if not cached:
        t0, load = time.perf_counter(), LOAD()
        try:
            figures = measure(model, candidates, workload, fuse, budget_s, timer)
            finite_figures(figures, key)
        except (RuntimeError, ValueError) as e:  # a backend that should run here failed: the fixed rule
            log.warning("svrmad: the linear calibration failed (%s); taking %s, the fixed rule", e, NAMES[candidates[0]])
            return Calibration(candidates[0], f"not measured ({e}): the fixed rule", {}, {}, workload, False, None)
        busy = load.share()
        log.info("svrmad: linear calibration took %.1f s", time.perf_counter() - t0)
        if busy is not None and busy > BUSY:
            log.warning("svrmad: the linear calibration was timed while other processes took %.0f%% of this "
                        "machine's CPU time: its figures choose for this run only and are not cached", 100 * busy)
        else:
            _write(path, key, figures)
    choice, cost = choose(figures, workload)
    costs = ", ".join(f"{NAMES[b]} {cost[b]:.3g}" for b in candidates)
    taken = " (cached)" if cached else f" while the machine was busy ({100 * busy:.0f}% of its CPU time went to " \
        "other processes; not cached)" if busy is not None and busy > BUSY else ""
    reason = (f"measured on this machine{taken}: ms per generated token at "
              f"{workload.prompt_per_generated:g} prompt tokens per generated one: {costs} (the run's own steps "
              f"weigh it again after {', '.join(map(str, RECHECK[:3]))}... steps)")
    if choice != "panels":
        reason += ("; its tokens may differ from another machine's (and a row's from its value in another batch): "
                   "--linear panels computes the same tokens on every machine")
    return Calibration(choice, reason, figures, cost, workload, cached, str(path), busy)


LOAD = OtherLoad  # what calibrate measures the machine's load with (tests replace it)


def table(cal: Calibration) -> str:
    """The figures as lines a person reads: one per step kind and size, ms per backend."""
    lines = []
    for kind, per_backend in cal.figures.items():
        sizes = next(iter(per_backend.values())).keys()
        for m in sizes:
            cells = "  ".join(f"{NAMES[b]} {per_backend[b][m]:9.2f}" for b in per_backend)
            lines.append(f"{kind:8s} M={m:<5s} {cells}")
    lines.append("chosen: " + cal.choice + " (" + cal.reason + ")")
    return "\n".join(lines)


RECORD = "_svrmad_linear_calibration"


def recorded(model: nn.Module) -> Calibration | None:
    """The calibration select_linear made for this model (None where it made none)."""
    return getattr(model, RECORD, None)
