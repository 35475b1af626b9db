"""One run's settings: `RunConfig`, built once from the command line (job/flags.py) and then passed
around whole.

It holds the dataset, the model, the agents, the methods and their parameters, plus the engine's
`EngineConfig` and the sampler's `SamplingParams`. Defaults are not repeated here: they are read
from those dataclasses and from the methods' signatures (the one deliberate exception is
`RUN_MAX_TOKENS`). A RunConfig is written into run.json, handed to every rank of a data-parallel
run, and its result-affecting part is the settings fingerprint that a resume compares
(docs/formats.md). It lives beside the run folder's format because run.json records it: the
post-hoc parts and `svrmad report` read it back from there.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from svrmad_local.analysis.options import METHODS, check_method_options, method_default, method_flag, stray_options
from svrmad_local.engine.config import EngineConfig, SamplingParams
from svrmad_local.methods import accepted_params

# The run's own --max-tokens default. The paper uses 16,384 (--paper-settings); 256 is what the
# embedded 135M default can afford on a CPU and still box an answer. SamplingParams' own default
# (512) is for library callers and does not apply to runs.
RUN_MAX_TOKENS = 256


# ---------------------------------------------------------------- the config


def _meta(flag: str, affects: bool = False) -> dict:
    """flag: how a message names this setting; affects: part of the settings fingerprint."""
    return {"flag": flag, "affects": affects}


@dataclass
class RunConfig:
    # data
    dataset: str = field(default="commonsenseqa", metadata=_meta("--dataset", True))  # docs/signals.md, "The default job"
    data_dir: str | None = field(default=None, metadata=_meta("--data-dir"))
    limit: int = field(default=8, metadata=_meta("--limit"))
    category: str | None = field(default=None, metadata=_meta("--category", True))
    shard: str | None = field(default=None, metadata=_meta("--shard"))
    on_error: str = field(default="skip", metadata=_meta("--on-error"))
    # model and engine
    model: str | None = field(default=None, metadata=_meta("--model", True))
    cache_dir: str | None = field(default=None, metadata=_meta("--cache-dir"))
    device: str | None = field(default=None, metadata=_meta("--device"))
    device_map: str | None = field(default=None, metadata=_meta("--device-map"))
    dtype: str | None = field(default=None, metadata=_meta("--dtype", True))
    tp: int = field(default=1, metadata=_meta("--tp"))
    quantization: str = field(default="auto", metadata=_meta("--quantization"))
    engine: EngineConfig = field(default_factory=EngineConfig, metadata=_meta("engine"))
    # sampling and prompts
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=RUN_MAX_TOKENS),
                                     metadata=_meta("sampling"))
    seed: int = field(default=0, metadata=_meta("--seed", True))
    reasoning_effort: str | None = field(default=None, metadata=_meta("--reasoning-effort", True))
    elicit_confidence: bool = field(default=True, metadata=_meta("confidence asked (--no-confidence)", True))
    paper_settings: str | None = field(default=None, metadata=_meta("--paper-settings"))
    # methods
    methods: list[str] = field(default_factory=lambda: ["svr-mad"], metadata=_meta("--methods", True))
    agents: int = field(default=6, metadata=_meta("--agents", True))
    method_params: dict[str, Any] = field(default_factory=dict, metadata=_meta("method options"))
    skip_rate: float | None = field(default=None, metadata=_meta("--skip-rate"))
    grader: str = field(default="ours", metadata=_meta("--grader", True))
    ablations: bool = field(default=False, metadata=_meta("--ablations", True))
    # the run itself (never changes a result)
    out: str | None = field(default=None, metadata=_meta("--out"))
    concurrency: int = field(default=16, metadata=_meta("--concurrency"))
    run_ahead: bool = field(default=False, metadata=_meta("--run-ahead"))
    save_token_stats: bool = field(default=False, metadata=_meta("--save-token-stats"))

    # -- derived -----------------------------------------------------------------------------
    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/{Path(self.dataset).stem}")

    @property
    def prior(self) -> str:
        """The signal the recorded priors are computed from."""
        return self.method_params.get("prior") or method_default("prior")

    def params_for(self, method: str) -> dict[str, Any]:
        """Keyword arguments for `method`: the given method options it takes, and the run's seed."""
        taken = accepted_params(method)
        out = {k: v for k, v in self.method_params.items() if k in taken}
        if "seed" in taken:
            out["seed"] = self.seed
        return out

    # -- run.json ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str | Path | None = None) -> RunConfig:
        """`where`: the run.json it was read from, named in the ValueError of a damaged one."""
        try:
            return _from_dict(cls, data)
        except (ValueError, TypeError) as exc:
            if where is None:
                raise
            raise ValueError(f"{where}: {exc}") from None

    def fingerprint(self) -> dict[str, Any]:
        """The settings that change a question's result, keyed by the flag that sets them. Method
        parameters are each method's effective values (defaults filled in), so giving a default
        explicitly changes nothing."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("affects"):
                out[f.metadata["flag"]] = getattr(self, f.name)
        out["--methods"] = sorted(self.methods)
        s = self.sampling
        out.update({"--max-tokens": s.max_tokens, "--temperature": s.temperature, "--top-p": s.top_p,
                    "--top-k": s.top_k})
        out["signals"] = dataclasses.asdict(self.engine.signals)
        for m in sorted(self.methods):
            for k, v in _effective_params(m, self.params_for(m)).items():
                out[f"{m} {method_flag(k)}"] = v
        return out

    # -- checks before anything is loaded ----------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming every bad setting (one line)."""
        p: list[str] = []
        mp = self.method_params
        for flag, value, low in (("--agents", self.agents, 2), ("--max-tokens", self.sampling.max_tokens, 1),
                                 ("--limit", self.limit, 0), ("--concurrency", self.concurrency, 1),
                                 ("--tp", self.tp, 1)):
            if value is not None and value < low:
                p.append(f"{flag} must be >= {low}, got {value}")
        p += check_method_options(mp, self.skip_rate)
        if self.shard is not None:
            try:
                parse_shard(self.shard)
            except ValueError as exc:
                p.append(str(exc))
        if self.out is not None and not str(self.out).strip():
            p.append("--out is empty: name a folder (default runs/<dataset>)")
        if "group-debate" in self.methods:
            groups = mp.get("groups") or method_default("groups")
            sizes = [int(s) for s in str(groups).split("-") if s.isdigit()]
            if len(sizes) != len(str(groups).split("-")) or sum(sizes) != self.agents or min(sizes) < 1:
                p.append(f"--groups {groups} does not split --agents {self.agents} (e.g. 3-3 for 6 agents)")
        stray = stray_options(self.methods, mp)
        if stray:
            p.append(f"{', '.join(stray)} given, but none of the methods ({', '.join(self.methods)}) takes it")
        if self.device_map and self.tp > 1:
            p.append("--device-map and --tp exclude each other")
        if self.model and not Path(self.model).expanduser().is_dir():
            p.append(f"--model {self.model} is not a folder (expected config.json + *.safetensors)")
        p += _check_out(self.out_dir)
        if p:
            raise ValueError("; ".join(p))


def parse_shard(spec: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise ValueError(f"--shard {spec!r}: expected K/N with 0 <= K < N, e.g. 0/4") from None
    return k, n


def _check_out(out: Path) -> list[str]:
    if out.exists() and not out.is_dir():
        return [f"--out {out} is a file, not a folder"]
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return [f"--out {out}: {probe} is a file, not a folder"]
    if not os.access(probe, os.W_OK | os.X_OK):
        return [f"--out {out}: {probe} is not writable"]
    return []


def _effective_params(method: str, given: dict[str, Any]) -> dict[str, Any]:
    """`method`'s keyword parameters with defaults filled in (only JSON-like values)."""
    out = {}
    for p in inspect.signature(METHODS[method]).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name == "priors":
            continue
        v = given.get(p.name, p.default)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[p.name] = v
    return out


def diff_fingerprints(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'flag: old -> new' for every setting that differs. A method's own parameters are compared only
    for a method both sides run (the others follow from --methods, which is named); a model folder is
    compared by the folder it names (`x/../x` is `x`)."""
    both = set(old.get("--methods") or []) & set(new.get("--methods") or [])
    keys = [k for k in dict.fromkeys([*old, *new]) if " " not in k or k.split(" ")[0] in both]

    def same(k: str) -> bool:
        a, b = old.get(k), new.get(k)
        if k == "--model" and isinstance(a, str) and isinstance(b, str):
            return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))
        return a == b

    return [f"{k} {_show(old.get(k))} in the folder, {_show(new.get(k))} now" for k in keys if not same(k)]


def _show(v: Any) -> str:
    if v is None:
        return "the default"
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def _from_dict(cls, data: dict):
    """A dataclass from asdict() output, nested dataclasses included; a field of the wrong kind (a
    run.json edited by hand) is a ValueError naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} settings are not a JSON object")
    if cls is RunConfig:
        methods = data.get("methods", [])
        if not isinstance(methods, list) or any(m not in METHODS for m in methods):
            raise ValueError(f"the run's methods {methods!r} are not a list of known methods ({', '.join(METHODS)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, tp = data[f.name], hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _from_dict(tp, value)
        kwargs[f.name] = value
    return cls(**kwargs)
