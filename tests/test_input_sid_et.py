"""SID-ET without SVR-MAD among the methods runs to its end and reports. Its skip
rate is tuned against SVR-MAD replayed from the trace (Algorithm 2), so a live question records
SVR-MAD's debates too (scripted agents: see runharness.py)."""

from __future__ import annotations

import json

import pytest

from svrmad_local import cli
from svrmad_local.debate.trace import row_debates

from .runharness import run, state, use_script


@pytest.mark.parametrize("methods", ["sid-et", "all-to-all,sid-et", "self-consistency,sid-et"])
def test_sid_et_without_svr_mad_runs_to_its_end(tmp_path, monkeypatch, capsys, methods):
    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--methods", methods) == 0
    got = state(out)
    debated = set(got["trace"])
    assert {i for i, m in got["results"] if m == "sid-et"} == debated == {"q1", "q3", "q4"}
    assert {m for _, m in got["results"]} == set(methods.split(","))  # SVR-MAD recorded, not reported
    assert got["meta"]["post_hoc"]["sid_et"]["skip_rate"] is not None
    assert "SID-ET" in capsys.readouterr().out
    # the same tuning as in a run that asked for SVR-MAD too
    both = tmp_path / "both"
    assert run(tmp_path, both, "--methods", f"{methods},svr-mad") == 0
    assert got["meta"]["post_hoc"]["sid_et"] == state(both)["meta"]["post_hoc"]["sid_et"]
    sid = {k: v for k, v in state(both)["results"].items() if k[1] == "sid-et"}
    assert sid == {k: v for k, v in got["results"].items() if k[1] == "sid-et"}
    assert cli.main(["report", str(out)]) == 0


def test_a_fixed_skip_rate_records_no_svr_mad(tmp_path, monkeypatch):
    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--methods", "sid-et", "--skip-rate", "0.5") == 0
    ids = {rid for row in state(out)["trace"].values() for rid in row_debates(row)}
    # all-to-all rounds hear every peer ('0<1+2+3'); SVR-MAD's one-peer debates ('0<1') are not needed
    assert ids and all("+" in rid for rid in ids), ids


def test_a_trace_without_svr_mad_debates_keeps_everything_and_says_how(tmp_path, monkeypatch, capsys):
    """A folder written before SVR-MAD was recorded for the tuning: the report still runs, the
    other rows stay, and one line says why SID-ET has none and what to pass."""
    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--methods", "self-consistency,sid-et", "--skip-rate", "0.5") == 0
    meta = json.loads((out / "run.json").read_text())
    meta["config"]["skip_rate"] = None  # as the tuning run wrote it
    meta.pop("post_hoc")
    (out / "run.json").write_text(json.dumps(meta))
    (out / "results.jsonl").write_text("".join(line + "\n" for line in (out / "results.jsonl").read_text().splitlines()
                                               if '"sid-et"' not in line))
    capsys.readouterr()
    assert cli.main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    assert "SID-ET has no rows" in err and "--skip-rate" in err and "Traceback" not in err
    assert {m for _, m in state(out)["results"]} == {"self-consistency"}
    # the advice works: a rerun with a fixed skip rate gives SID-ET its rows
    assert run(tmp_path, out, "--methods", "self-consistency,sid-et", "--skip-rate", "0.5") == 0
    assert {m for _, m in state(out)["results"]} == {"self-consistency", "sid-et"}
