"""The GPU check for a bare, offline GPU machine (what benchmarks/gpu_check.sh runs), in steps.

    benchmarks/gpu_check.sh OUTDIR [--steps 1|2|3|a,b,...]  on the GPU machine
    benchmarks/gpu_check.sh --dry-run OUTDIR                on a CPU machine: everything but CUDA

It installs nothing into the machine's Python: the wheels carried in .whl/ (downloaded beforehand by
FETCH) go into a private folder with `pip install --no-index --no-deps --target`, only where the
installed release does not meet what we need; the project is imported from the working tree on
PYTHONPATH (svrmad_local/ holds every module, kernels/ included), so neither setuptools nor the network
is needed. It builds every model it needs
on the spot (config folders at the real shapes of the embedded default and of a 1.7B Qwen3, with a
tokenizer trained here, for random weights; tiny MXFP4 GPT-OSS and FP8 DeepSeek-V3 checkpoints in the
published layouts from tests/quant_zoo.py; GPT-OSS-120B's config cut to 4 layers, `long_model`), then runs the steps (each killed if the call's time runs out), and writes
OUTDIR/summary.json: {"steps": [{"name", "status": "ran" | "skipped", "reason", "needs_cuda", "result":
"pass" | "fail" (where it ran), "seconds", "command", "figures", "log"}], ...}. Every step's output is kept
in OUTDIR/logs/NAME.log. A step needing CUDA is "skipped" on a CPU, with its command. Steps that cannot
finish within the call's time left (--budget-s, 570 s by default: under a 10-minute limit on a command)
are skipped with that reason, so one call never overruns. How to run it: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
# What .whl/ holds, and the command that fetches it (on a machine with the network, beforehand). A GPU image
# with torch, Triton and a transformers inside pyproject's range (>=5.17) runs as it comes, so only pytest (with
# pytest-xdist and execnet: the tests step's workers) and gguf are carried; a machine whose release is outside the
# range is refused by the deps step, naming it.
FETCH = ('pip download --no-deps -d .whl pytest pluggy iniconfig pytest-xdist execnet '
         'gguf')  # gguf: often missing from GPU images
CARRY_LIMIT = 64 * 2**20
FIRST = ["env", "deps", "package", "models"]  # every call runs these first (each a few seconds)
# Parts 4 and 5 time the paper's two models' paths: `quant` (the packed MXFP4 and FP8 GEMMs at batch 1 and
# prefill sizes against cuBLAS on the dequantized weights and the bytes they read, with a sweep of tilings
# at batch 1), `mla-*` (absorbed MLA decode at 128 heads and a TP-8 rank's 16, 1k and 16k tokens, against
# the latent's read rate), `long-1k` / `long-16k` (decode tok/s at batch 1 and 32 after 1k and 16k prompt
# tokens, GPT-OSS-120B at 4 layers) and `memory` (a 16k-token run at the default KV budget: peak reserved
# against the total, the profiled forward against the plan's estimate). Part 6, `decode-peer`, times decode
# beside the peer that needs no install: transformers' generate with its static cache under torch.compile
# (bench_decode --hf-compile), at batch 1, 8 and 32, in the same run.
GPU_STEPS = ["tests", "graphs", "bf16", "flash", "run", "kernels", "fused", "skinny", "engine", "decode", "decode-peer",
             "profile", "quant", "mla", "long", "memory"]
PARTS = {"1": FIRST + ["tests", "graphs", "bf16", "flash", "run"], "2": FIRST + ["kernels", "fused", "skinny", "decode"],
         "3": FIRST + ["engine"], "4": FIRST + ["quant", "mla"], "5": FIRST + ["long", "memory"],
         "6": FIRST + ["decode-peer"]}
PEER_MODELS = ["qwen3-1.7b"]
# the paper's main model at a few layers (random bf16 weights at GPT-OSS-120B's real widths, two sliding and two
# full layers, all 128 experts: ~28 GB): the long-context decode and memory steps' model
LONG_MODEL, LONG_LAYERS = "gpt-oss-120b-4l", 4
ENGINE_MODELS = ["smollm2-135m", "qwen3-1.7b"]
# the ways the GPU path was found able to fail, and the step whose failure names each (the CPU tests cover
# the fallback inside a capture, the paged prefill sync and the blocking copies too)
DEFECTS = {
    "MoE capture": "graphs: gpt-oss-mxfp4 and deepseek-fp8 must capture every decode shape (a failed shape is "
                     "named with its error)",
    "fallback inside a capture": "graphs: no Triton kernel may fall back (kernels_fell_back), no shape may fail",
    "paged prefill sync": "graphs: no host sync from paged_prefill.py in any step (host_syncs lists all)",
    "capture at start-up": "graphs: every shape captured at build, graph memory within what the KV budget kept",
    "blocking copies": "graphs: no blocking host->device copy in any step (host_syncs)",
    "Triton resource limits": "tests (the compiled kernels against their references) and graphs (kernels_fell_back "
                                "names a kernel whose compile failed)",
    "flash-attn": "flash: the installed flash-attn, paged (block 256) and over a gather (block 16), against the bf16 "
                    "reference; skipped with the reason where it is not installed",
    "bare machine": "deps, package, models: offline installs, the package from the tree, models built here",
    "bf16 checked": "bf16: greedy tokens and log-probs against a cache-free bf16 reference",
}


@dataclass
class Step:
    name: str
    needs_cuda: bool
    status: str = "skipped"
    reason: str = ""
    result: str | None = None
    seconds: float = 0.0
    command: list[str] | None = None
    figures: dict = field(default_factory=dict)
    log: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class Check:
    def __init__(self, out: Path, dry: bool, budget_s: float):
        self.out, self.dry, self.t0, self.budget = out, dry, time.monotonic(), budget_s
        self.work = Path(os.environ.get("SVRMAD_GPU_CHECK_WORK", "/tmp/svrmad-gpu-check"))
        self.site, self.models = self.work / "site", self.work / "models"
        self.cache = self.work / "no-default-model"  # the steps' SVRMAD_CACHE: no default model, their kept timings
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.steps: list[Step] = []
        self.cuda = False

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def env(self) -> dict:
        """The children's environment: the private site folder, then the working tree, first on the path;
        no network, no download of the default model (every step passes its model)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_INTERPRET="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", SVRMAD_CACHE=str(self.cache))
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(ROOT)] +
                                            [p for p in [os.environ.get("PYTHONPATH")] if p])
        return env

    def keep_timings(self) -> list[str]:
        """The timings the steps' engines kept (engine/kept.py: every few-row linear config and sampling path a
        build timed, the gated down projections' included), copied to logs/calibration/ beside the logs: what
        each pick was chosen over, which the record's picks alone do not say. Their file names."""
        found = sorted((self.cache / "calibration").glob("*.json"))
        if found:
            (self.out / "logs" / "calibration").mkdir(exist_ok=True)
        for f in found:
            shutil.copy2(f, self.out / "logs" / "calibration" / f.name)
        return [f.name for f in found]

    def run(self, step: Step, cmd: list[str], expect: int, parse=None) -> None:
        """Runs `cmd` if the call has `expect` seconds left (a generous guess of the step's time on an
        H100), killed when the call's time runs out; its output in logs/NAME.log; pass = exit 0 (and
        `parse` may add figures and turn it into a fail: it returns (figures, failures))."""
        step.command = cmd
        if step.needs_cuda and not self.cuda:
            step.reason = "needs CUDA: " + ("dry run on a CPU machine" if self.dry else "no CUDA device here")
            return
        if self.left() < expect:
            step.reason = (f"{self.left():.0f} s left in this call, the step may take {expect} s: run it in the next "
                           f"call (--steps {group_of(step.name)})")
            return
        limit = int(self.left())
        log = self.out / "logs" / f"{step.name}.log"
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=limit)
            text, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            text, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
        step.seconds = round(time.monotonic() - t0, 1)
        log.write_text(text)
        step.status, step.log = "ran", str(log.relative_to(self.out))
        failures = []
        if code is None:
            failures.append(f"timed out after {limit} s")
        elif code != 0:
            failures.append(f"exit {code}: {_last_line(text)}")
        if parse is not None:
            try:
                figures, more = parse(text)
                step.figures.update(figures)
                failures += more
            except Exception as e:  # noqa: BLE001 - a step's odd output must not lose the others
                failures.append(f"could not read the step's output: {e!r}")
        if "skipped" in step.figures and not failures:  # the probe found nothing to test (flash-attn absent)
            step.status, step.reason = "skipped", step.figures.pop("skipped")
            return
        step.result = "fail" if failures else "pass"
        step.reason = "; ".join(failures)

    def local(self, step: Step, fn) -> None:
        """A step run in this process (no CUDA): fn(step) fills figures and returns failures."""
        t0 = time.monotonic()
        try:
            failures = fn(step) or []
        except Exception as e:  # noqa: BLE001
            failures = [f"{type(e).__name__}: {e}"]
        step.seconds = round(time.monotonic() - t0, 1)
        step.status, step.result = "ran", "fail" if failures else "pass"
        step.reason = "; ".join(failures)

    # -- the steps that need no GPU ------------------------------------------------------------
    def step_env(self, step: Step):
        py = [sys.executable, "-c", "import json, torch, sys; d = torch.cuda.is_available(); print(json.dumps({"
              "'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda, "
              "'device': torch.cuda.get_device_name() if d else None, 'cuda_available': d}))"]
        out = subprocess.run(py, capture_output=True, text=True, env=self.env(), timeout=120)
        if out.returncode != 0:
            return [f"torch does not import: {_last_line(out.stderr)}"]
        step.figures.update(json.loads(out.stdout.strip().splitlines()[-1]))
        self.cuda = bool(step.figures["cuda_available"])
        for dist in ("transformers", "triton", "flash-attn", "huggingface-hub", "tokenizers", "setuptools"):
            step.figures[dist] = _version(dist)
        if shutil.which("nvidia-smi"):
            step.figures["nvidia-smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
        return []

    def step_deps(self, step: Step):
        """Installs a carried wheel only where the release here does not meet a requirement (the project's,
        or a wheel's that is being installed), then checks those requirements are all met."""
        wheels = sorted(WHEELS.glob("*.whl"))
        step.figures["carried"] = [w.name for w in wheels]
        todo, needs = _plan(wheels, _version)
        # what a machine with the lowest transformers of our range (5.17, and at worst the oldest hub) would need
        lowest = {"transformers": "5.17.0", "huggingface-hub": "1.5.0"}
        step.figures["install_on_lowest_transformers"] = [w.name for w in _plan(wheels, lambda d: lowest.get(
            _norm(d)) or _version(d))[0]]
        step.figures["install"] = [w.name for w in todo]
        if todo and not self.dry:
            self.site.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                   "--target", str(self.site), *map(str, todo)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            step.command = cmd
            if proc.returncode != 0:
                return [f"pip install failed: {_last_line(proc.stderr)}"]
        if self.dry:
            step.figures["would_run"] = ("pip install --no-index --no-deps --target " + str(self.site) + " "
                                         + " ".join(w.name for w in todo)) if todo else "nothing to install here"
        installed = {_norm(_wheel_name(w)[0]): _wheel_name(w)[1] for w in todo}
        unmet = []
        for r in needs:
            have = installed.get(_norm(r.name)) or _version(r.name)
            if have is None or not r.specifier.contains(have, prereleases=True):
                unmet.append(f"{r} (have {have})")
        step.figures["unmet"] = unmet
        return [f"requirements not met: {', '.join(unmet)}"] if unmet and not self.dry else []

    def step_package(self, step: Step):
        """svrmad_local from the working tree, with no install: the tree on PYTHONPATH is the whole package,
        whatever order sys.path puts it in (the benchmarks and pytest put it first). No setuptools, no
        network."""
        probe = ("import sys; sys.path.insert(0, {root!r}); import svrmad_local.kernels as k, "
                 "svrmad_local.engine.engine, transformers; print(k.__file__, transformers.__version__)")
        env = dict(self.env(), PYTHONPATH=os.pathsep.join([str(self.site), str(ROOT)]))
        # the tree first on the path (as the benchmarks put it), or only after: two processes at once (each
        # imports torch and transformers, ~13 s on a GPU machine's first call)
        procs = [subprocess.Popen([sys.executable, "-c", probe.format(root=root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd="/") for root in (str(ROOT), "/")]
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=300))
            except subprocess.TimeoutExpired:
                proc.kill()
                outs.append((proc.communicate()[0], "timed out after 300 s"))
        for proc, (_, stderr) in zip(procs, outs):
            if proc.returncode != 0:
                return [f"the package does not import: {_last_line(stderr)}"]
        where, tf = outs[-1][0].split()
        step.figures.update(kernels=where, transformers=tf)
        return [] if Path(where).resolve().is_relative_to(ROOT) else [f"imported from {where}, not the working tree"]

    def step_models(self, step: Step):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), "models", str(self.models)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), cwd=ROOT, timeout=300)
        step.command = cmd
        (self.out / "logs" / "models.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            return [f"building the models failed: {_last_line(out.stderr or out.stdout)}"]
        step.figures.update(json.loads(out.stdout.strip().splitlines()[-1]))
        step.figures["models"][LONG_MODEL] = str(long_model(self.models))
        return []

    def step_carry(self, step: Step):
        """What travels to the GPU machine: the working tree (tracked and untracked files git does not
        ignore) plus .whl/; the run tool's limit is 64 MiB in all."""
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                               text=True).stdout.split("\0")
        tree = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())
        wheels = {w.name: w.stat().st_size for w in sorted(WHEELS.glob("*.whl"))}
        total = tree + sum(wheels.values())
        step.figures.update(tree_bytes=tree, tree_files=len([f for f in files if f]), carry=[".whl"],
                            wheels=wheels, total_bytes=total, limit_bytes=CARRY_LIMIT, fetch_wheels=FETCH)
        return [] if total < CARRY_LIMIT else [f"{total} bytes to carry, over the {CARRY_LIMIT} limit"]


def group_of(name: str) -> str:
    """The --steps name that runs step `name` (`decode-peer-qwen3-1.7b` -> decode-peer, `host-ops-...` -> decode)."""
    if name.startswith("host-ops"):
        return "decode"
    return max((g for g in GPU_STEPS if name == g or name.startswith(g + "-")), key=len, default=name.split("-")[0])


def long_model(models: Path) -> Path:
    """GPT-OSS-120B's published config cut to its first LONG_LAYERS layers, without its quantization (random
    bf16 weights), beside the harmony tokenizer the models step trained for the packed GPT-OSS."""
    folder = models / LONG_MODEL
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ROOT / "tests" / "fixtures" / "configs" / "gpt-oss-120b" / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["num_hidden_layers"], cfg["layer_types"] = LONG_LAYERS, cfg["layer_types"][:LONG_LAYERS]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer = models / "gpt-oss-mxfp4"
    for f in tokenizer.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def _plan(wheels, version):
    """(wheels to install, requirements to meet): starting from pyproject's dependencies, a carried wheel
    is installed where `version(name)` does not meet a requirement on it; its own requirements then
    join the list (so a carried transformers would bring its huggingface-hub bound), until nothing changes."""
    import tomllib

    from packaging.requirements import Requirement

    by_name = {_norm(_wheel_name(w)[0]): w for w in wheels}
    needs = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    todo: list[Path] = []
    while True:
        needs = [r for r in needs if r.marker is None or r.marker.evaluate()]
        more = []
        for r in needs:
            w = by_name.get(_norm(r.name))
            have = version(r.name)
            if w is not None and w not in todo and (have is None or not r.specifier.contains(have, prereleases=True)):
                more.append(w)
        if not more:  # a carried wheel nobody requires (pytest, for the tests): only where it is missing
            more = [w for w in wheels if w not in todo and version(_wheel_name(w)[0]) is None
                    and not any(_norm(r.name) == _norm(_wheel_name(w)[0]) for r in needs)][:1]
        if not more:
            return todo, needs
        for w in more:
            todo.append(w)
            needs += _wheel_requirements(w)


def _wheel_requirements(w: Path):
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [Requirement(line.split(":", 1)[1].strip()) for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]


def _wheel_name(w: Path) -> tuple[str, str]:
    name, version = w.name.split("-")[:2]
    return name, version


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _probe_json(text: str):
    """gpu_probe.py, gpu_tests.py and bench_memory.py print one JSON object last: their figures, and their
    `failures` (bench_memory's: an OOM, a peak past the total)."""
    obj = json.loads(text.strip().splitlines()[-1])
    return obj, obj.pop("failures", [])


def _peer_json(text: str):
    """bench_decode --hf-compile's last line; a batch size the peer failed at fails the step, with its line."""
    obj, failures = _last_json(text)
    failures += [f"the peer at batch {r['batch']}: {r['hf_compile_error']}" for r in obj.get("rows", [])
                 if "hf_compile_error" in r]
    return obj, failures


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line), []
    return {}, ["no JSON result line"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="where summary.json and logs/ go")
    ap.add_argument("--dry-run", action="store_true", help="a CPU machine: everything but CUDA")
    ap.add_argument("--steps", help="comma-separated step names, or a part: 1 (tests, graphs, bf16, flash), "
                                    "2 (kernels, fused, skinny, decode), 3 (engine), 4 (quant, mla), 5 (long, memory) or 6 "
                                    "(decode-peer); default: all. env, deps, package, models always run")
    ap.add_argument("--budget-s", type=float, default=570.0, help="time this call may take (default 570)")
    ap.add_argument("--engine-models", default=",".join(ENGINE_MODELS),
                    help=f"the engine step's models (default {','.join(ENGINE_MODELS)})")
    ap.add_argument("--decode-models", default=ENGINE_MODELS[0],
                    help=f"the decode step's models, of {','.join(ENGINE_MODELS)} (default {ENGINE_MODELS[0]})")
    ap.add_argument("--peer-models", default=",".join(PEER_MODELS),
                    help=f"the decode-peer step's models, of {','.join(ENGINE_MODELS)} (default {','.join(PEER_MODELS)})")
    ap.add_argument("--decoders", default="auto",
                    help="the decode and profile steps' --decoder values, comma-separated (default auto; e.g. "
                         "auto,ours,modules times each side by side)")
    ap.add_argument("--graphs", default="auto,off",
                    help="the decode and profile steps' cuda_graphs values (default auto,off: with graphs and without)")
    ap.add_argument("--overlaps", default="auto,off",
                    help="the decode step's overlap values where graphs are on (default auto,off: each decode step "
                         "launched before the previous one's tokens are read, and not)")
    ap.add_argument("--test-workers", type=int, default=4,
                    help="the tests step's pytest-xdist workers where xdist is installed (default 4; 1: one process); "
                         "a test that fails among them is run again alone")
    ap.add_argument("--pdls", default="auto,off",
                    help="the decode and profile steps' pdl values where graphs are on (default auto,off: each kernel "
                         "launched while the one before runs, and not)")
    args = ap.parse_args(argv)
    chk = Check(args.out, args.dry_run, args.budget_s)
    wanted = PARTS.get(args.steps or "", None) or (FIRST + (args.steps.split(",") if args.steps else GPU_STEPS))
    bad = sorted(set(args.decoders.split(",")) - {"auto", "ours", "modules"})
    if bad:
        print(f"gpu_check: unknown decoder(s) {', '.join(bad)}; decoders: auto, ours, modules", file=sys.stderr)
        return 2
    for name, values in (("overlap", args.overlaps), ("pdl", args.pdls)):
        bad = sorted(set(values.split(",")) - {"auto", "on", "off"})
        if bad:
            print(f"gpu_check: unknown {name} value(s) {', '.join(bad)}; values: auto, on, off", file=sys.stderr)
            return 2
    if args.test_workers < 1:
        print(f"gpu_check: --test-workers must be 1 or more, not {args.test_workers}", file=sys.stderr)
        return 2
    models = set(args.engine_models.split(",")) | set(args.decode_models.split(",")) | set(args.peer_models.split(","))
    if not models <= set(ENGINE_MODELS):
        print(f"gpu_check: unknown model(s) {', '.join(sorted(models - set(ENGINE_MODELS)))}; models: "
              f"{', '.join(ENGINE_MODELS)}", file=sys.stderr)
        return 2
    unknown = sorted(set(wanted) - set(FIRST + GPU_STEPS + ["carry"]))
    if unknown:
        print(f"gpu_check: unknown step(s) {', '.join(unknown)}; steps: {', '.join(FIRST + GPU_STEPS)}", file=sys.stderr)
        return 2
    py, m = sys.executable, chk.models
    steps: list[Step] = []

    def add(name, needs_cuda):
        steps.append(Step(name, needs_cuda))
        return steps[-1]

    for name, fn in (("env", chk.step_env), ("deps", chk.step_deps), ("package", chk.step_package),
                     ("models", chk.step_models)):
        chk.local(add(name, False), fn)
    if args.dry_run or "carry" in wanted:
        chk.local(add("carry", False), chk.step_carry)
    ready = all(s.result == "pass" for s in steps if s.name in ("package", "models"))
    plan = []  # each step's `expect`: seconds it took on an H200 (docs/measurements.md), with room
    if "tests" in wanted:
        # over pytest-xdist's workers where it is installed (the host's kernel compiles in parallel), a test that
        # fails among them run again alone (benchmarks/gpu_tests.py)
        plan.append(("tests", [py, "benchmarks/gpu_tests.py", "--workers", str(args.test_workers), "--",
                               "tests/test_gpu.py", "tests/test_mla.py::test_prefill_chunks_on_cuda_take_the_memory_"
                               "efficient_kernel_and_match_fp32"], 240, _probe_json))
    probe = [py, "benchmarks/gpu_probe.py"]
    if "graphs" in wanted:  # every model captures every shape, no kernel falls back, no blocking copy
        plan.append(("graphs", probe + ["graphs", str(m)], 90, _probe_json))
    if "bf16" in wanted:
        plan.append(("bf16", probe + ["bf16", str(m)], 30, _probe_json))
    if "flash" in wanted:  # flash-attn where installed
        plan.append(("flash", probe + ["flash", str(m)], 60, _probe_json))
    if "run" in wanted:  # the main job, svrmad run with every method, on the device
        plan.append(("run", probe + ["run", str(m)], 45, _probe_json))
    if "kernels" in wanted:
        plan.append(("kernels", [py, "benchmarks/bench_kernels.py", "--device", "cuda"], 60, _last_json))
    if "fused" in wanted:  # the decoder's small ops in Triton against their torch references, eager and graphed
        plan.append(("fused", [py, "benchmarks/bench_fused.py", "--json"], 60, _last_json))
    if "fused" in wanted:  # a decode step's sampling and statistics: the two Triton kernels against torch's ops
        plan.append(("sampling", [py, "benchmarks/bench_sampling.py", "--device", "cuda", "--rounds", "5"], 30,
                     _last_json))
    if "skinny" in wanted:  # the few-row linear against cuBLAS at Qwen3-1.7B's decode shapes, every config
        plan.append(("skinny", [py, "benchmarks/bench_skinny.py", "--json", "--chain", "28", "--floor"], 210,
                     _last_json))
    wl = ["--questions", "4", "--initial-tokens", "128", "--debate-tokens", "64"]
    if "engine" in wanted:
        for model in args.engine_models.split(","):
            base = [py, "benchmarks/bench_engine.py", "--model", str(m / model), "--random-weights", "--device", "cuda",
                    "--dtype", "bf16"]
            # the plain generate loops (about 100 s and 40 s on an H100) for the small shape only
            extra = ["--batched-baseline"] if model == ENGINE_MODELS[0] else ["--skip-naive"]
            plan.append((f"engine-{model}", base + extra + wl, 180 if extra[0] == "--batched-baseline" else 40,
                         _last_json))
            plan.append((f"engine-{model}-nographs", base + ["--engine", "cuda_graphs=off", "--skip-naive"] + wl, 40,
                         _last_json))
    for model in args.decode_models.split(","):
        tag = "" if model == ENGINE_MODELS[0] else f"-{model}"  # the default's decode step names as before
        for decoder in args.decoders.split(","):
            dtag = "" if decoder == "auto" else f"-decoder-{decoder}"
            for graphs in args.graphs.split(","):
                base = [py, "benchmarks/bench_decode.py", "--model", str(m / model), "--random-weights",
                        "--dtype", "bf16", "--engine", f"cuda_graphs={graphs},decoder={decoder}"]
                # the same with each other pdl value (graphs on): the engine's setting, and the step name's tag
                pdls = [(base[:-1] + [base[-1] + f",pdl={p}"], f"-pdl-{p}") for p in args.pdls.split(",")
                        if p != "auto" and graphs != "off"]
                if "decode" in wanted:
                    for overlap in args.overlaps.split(",") if graphs != "off" else ["auto"]:
                        otag = "" if overlap == "auto" else f"-overlap-{overlap}"
                        engine = base[-1] + ("" if overlap == "auto" else f",overlap={overlap}")
                        plan.append((f"decode{tag}{dtag}-graphs-{graphs}{otag}", base[:-1] + [engine, "--batches", "1,8,32"],
                                     90, _last_json))
                    for cmd, ptag in pdls:
                        plan.append((f"decode{tag}{dtag}-graphs-{graphs}{ptag}", cmd + ["--batches", "1,8,32"], 90,
                                     _last_json))
                    plan.append((f"host-ops{tag}{dtag}-graphs-{graphs}", base + ["--host-ops", "--json"], 20,
                                 _last_json))
                if "profile" in wanted:  # where a decode step's time goes: the host, the device, which kernels
                    plan.append((f"profile-{model}{dtag}-graphs-{graphs}",
                                 base + ["--profile", "1,32", "--new-tokens", "32"], 40, _last_json))
                    for cmd, ptag in pdls:  # without PDL a kernel's own time is its work alone (with it, also its wait)
                        plan.append((f"profile-{model}{dtag}-graphs-{graphs}{ptag}",
                                     cmd + ["--profile", "1,32", "--new-tokens", "32"], 40, _last_json))
    if "decode-peer" in wanted:  # the engine (graphs auto) and transformers' compiled generate, same prompts, one run
        for model in args.peer_models.split(","):
            plan.append((f"decode-peer-{model}", [py, "benchmarks/bench_decode.py", "--model", str(m / model),
                                                  "--random-weights", "--dtype", "bf16", "--batches", "1,8,32",
                                                  "--hf-compile"], 300, _peer_json))
    # the packed GEMMs and absorbed MLA at the paper's shapes against the device's read rate, and the paper's
    # main model at long contexts: decode at 1k and 16k, and the memory a 16k run holds at the default budget
    if "quant" in wanted:
        plan.append(("quant", [py, "benchmarks/bench_quant.py", "--ms", "1,8,512,2048", "--reps", "10", "--sweep"],
                     300, _last_json))
    if "mla" in wanted:
        mla = [py, "benchmarks/bench_mla.py", "--dtype", "bf16", "--device", "cuda", "--json"]
        plan.append(("mla-128-heads", mla + ["--heads", "128", "--contexts", "1024,16384", "--sweep"], 120, _last_json))
        plan.append(("mla-16-heads-tp8-rank", mla + ["--heads", "16", "--contexts", "1024,16384", "--sweep"], 90,
                     _last_json))
        plan.append(("mla-128-heads-batch32", mla + ["--heads", "128", "--contexts", "16384", "--batch", "32",
                                                     "--skip-expanded"], 60, _last_json))
    long = [py, "benchmarks/bench_decode.py", "--model", str(m / LONG_MODEL), "--random-weights", "--dtype", "bf16",
            "--batches", "1,32", "--new-tokens", "64", "--repeat", "1"]
    if "long" in wanted:
        plan.append(("long-1k", long + ["--prompt-tokens", "1024"], 180, _last_json))
        plan.append(("long-16k", long + ["--prompt-tokens", "16384"], 420, _last_json))
    if "memory" in wanted:
        plan.append(("memory", [py, "benchmarks/bench_memory.py", "--model", str(m / LONG_MODEL), "--random-weights",
                                "--sequences", "8", "--prompt-tokens", "16384", "--new-tokens", "32"], 240,
                     _probe_json))
    for name, cmd, expect, parse in plan:
        step = add(name, True)
        if not ready:
            step.command, step.reason = cmd, "the package or the models are not ready (see those steps)"
            continue
        chk.run(step, cmd, expect, parse)
        print(f"== {name}: {step.status} {step.result or ''} {step.reason}".rstrip(), flush=True)
    summary = {"dry_run": args.dry_run, "cuda": chk.cuda, "seconds": round(time.monotonic() - chk.t0, 1),
               "steps": [s.as_dict() for s in steps], "defects_checked_by": DEFECTS, "timings_kept": chk.keep_timings()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for s in steps:
        print(f"{s.name:28s} {s.status:8s} {s.result or '':5s} {s.reason[:150]}")
    ran = [s for s in steps if s.status == "ran"]
    return 1 if any(s.result == "fail" for s in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
