"""One run config: built once from the command line, defaults taken from their owners, presets
overridable, serialisable, and one group of method options for `run` and `replay`."""

from __future__ import annotations

import argparse

import pytest

from svrmad_local.engine.engine import EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.analysis import run_config as C
from svrmad_local.analysis import options as O
from svrmad_local.analysis import replay as replay_cli
from svrmad_local.job import flags as F
from svrmad_local.job import run as run_cli
from svrmad_local.methods import svr_mad


def run_args(*argv):
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    return p.parse_args(list(argv))


def parser_flags(add) -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    add(p)
    return {s: a for a in p._actions for s in a.option_strings}


def test_defaults_come_from_their_owners():
    cfg = F.from_args(run_args())
    sp, ec = SamplingParams(), EngineConfig()
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (sp.temperature, sp.top_p, sp.top_k)
    assert cfg.sampling.max_tokens == C.RUN_MAX_TOKENS == 256
    assert (cfg.engine.block_size, cfg.engine.max_num_seqs) == (ec.block_size, ec.max_num_seqs)
    assert cfg.method_params == {}  # the methods' own defaults apply
    assert cfg.params_for("svr-mad") == {} and cfg.params_for("group-debate") == {"seed": 0}
    assert cfg.prior == "min_ll" == C.method_default("prior")


def test_max_tokens_is_labelled_honestly():
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    group = next(g for g in p._action_groups if any("--max-tokens" in a.option_strings for a in g._group_actions))
    assert "16,384" in group.title and "paper defaults" not in group.title
    action = next(a for a in group._group_actions if "--max-tokens" in a.option_strings)
    assert "256" in action.help and "CPU" in action.help


@pytest.mark.parametrize("preset, sc", [("gpt-oss", 2), ("deepseek", 3)])
def test_paper_settings_preset(preset, sc):
    cfg = F.from_args(run_args("--paper-settings", preset))
    assert cfg.sampling.max_tokens == 16384 and cfg.reasoning_effort == "medium"
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (1.0, 0.95, 40)
    assert cfg.params_for("svr-mad") == {"S": sc, "C": sc}
    assert cfg.paper_settings == preset


def test_explicit_flags_override_a_preset():
    cfg = F.from_args(run_args("--paper-settings", "deepseek", "--max-tokens", "512", "--C", "2",
                               "--reasoning-effort", "low", "--temperature", "0.7"))
    assert cfg.sampling.max_tokens == 512 and cfg.reasoning_effort == "low" and cfg.sampling.temperature == 0.7
    assert cfg.params_for("svr-mad") == {"S": 3, "C": 2}
    # a preset's S/C do not reach a run without a method that takes them (no stray-option error)
    cfg = F.from_args(run_args("--paper-settings", "gpt-oss", "--methods", "self-consistency"))
    assert cfg.method_params == {}
    cfg.validate()


def test_round_trip_through_run_json():
    cfg = F.from_args(run_args("--methods", "svr-mad,group-debate", "--S", "3", "--kv-cache-memory", "4MiB",
                               "--paper-settings", "gpt-oss", "--no-confidence"))
    again = C.RunConfig.from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.engine, EngineConfig) and isinstance(again.sampling, SamplingParams)
    assert again.fingerprint() == cfg.fingerprint()


def test_run_and_replay_share_the_method_options():
    run_flags, replay_flags = parser_flags(run_cli.add_arguments), parser_flags(replay_cli.add_arguments)
    method_flags = {o.flag for o in O.METHOD_OPTIONS} | {"--skip-rate", "--grader"}
    assert method_flags <= set(run_flags) and method_flags <= set(replay_flags)
    for flag in method_flags:  # the same action: same destination, choices and default
        a, b = run_flags[flag], replay_flags[flag]
        assert (a.dest, a.choices, a.default, a.help) == (b.dest, b.choices, b.default, b.help)
    # the options other helpers add to the methods are there, filtered per method
    assert {"--no-repeat-pairs", "--accept-exhausted", "--s2-peers", "--grader"} <= method_flags


def test_method_options_reach_only_the_methods_that_take_them():
    cfg = F.from_args(run_args("--methods", "svr-mad,group-debate", "--S", "3", "--groups", "2-2-2"))
    assert cfg.params_for("svr-mad") == {"S": 3}
    assert cfg.params_for("group-debate") == {"groups": "2-2-2", "seed": 0}
    with pytest.raises(ValueError, match="--S given, but none of the methods"):
        F.from_args(run_args("--methods", "self-consistency", "--S", "3")).validate()


def test_fingerprint_fills_defaults_and_names_flags():
    a = F.from_args(run_args())
    b = F.from_args(run_args("--S", str(svr_mad.run.__kwdefaults__["S"]), "--concurrency", "3"))
    assert a.fingerprint() == b.fingerprint()  # a default given explicitly, or a non-result setting
    assert F.from_args(run_args("--cascade", "on")).engine.cascade == "on"
    assert F.from_args(run_args("--cascade", "on")).fingerprint() == a.fingerprint()  # exact either way
    c = F.from_args(run_args("--agents", "3", "--max-tokens", "12", "--C", "3"))
    diff = C.diff_fingerprints(a.fingerprint(), c.fingerprint())
    assert any(d.startswith("--agents 6 in the folder, 3 now") for d in diff)
    assert any(d.startswith("--max-tokens 256") for d in diff)
    assert any(d.startswith("svr-mad --C 2") for d in diff)
    assert len(diff) == 3


def test_a_settings_difference_names_what_the_user_changed(tmp_path):
    """Changing --methods names --methods, not every parameter of the method left out; one model folder
    spelled two ways is the same folder; an unset setting shows as the default, not None."""
    a = F.from_args(run_args("--methods", "svr-mad", "--model", str(tmp_path)))
    b = F.from_args(run_args("--methods", "self-consistency", "--model", str(tmp_path / ".." / tmp_path.name)))
    assert C.diff_fingerprints(a.fingerprint(), b.fingerprint()) == [
        "--methods svr-mad in the folder, self-consistency now"]
    c = F.from_args(run_args("--methods", "svr-mad", "--model", str(tmp_path), "--dtype", "bf16"))
    assert C.diff_fingerprints(a.fingerprint(), c.fingerprint()) == ["--dtype the default in the folder, bf16 now"]
    d = F.from_args(run_args("--methods", "svr-mad", "--model", str(tmp_path / "other")))
    assert [x.split(" ")[0] for x in C.diff_fingerprints(a.fingerprint(), d.fingerprint())] == ["--model"]
