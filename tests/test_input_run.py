"""`svrmad run` checks everything that reads no weight before it
loads, writes or takes the lock (job/preflight.py), and a start that fails later leaves a folder
the next valid command takes over. Tiny checkpoints written here; the agents are scripted, so
`make_backend` (the model load) is the seam: a test that must stop before it makes it raise."""

from __future__ import annotations

import json
import re

import pytest
import torch

from svrmad_local import cli
from svrmad_local.job import run as run_mod
from svrmad_local.models.loader import ModelLoadError, check_device, check_folder

from .runharness import PerQuestion, state, write_dataset
from .test_input_checkpoints import ck  # noqa: F401  (the tiny checkpoint fixture)


@pytest.fixture
def loads(monkeypatch):
    """make_backend: scripted agents, or (after `loads.fail = exc`) a load that fails; counts calls."""
    class Seam:
        calls, fail = 0, None

    def make(job):
        Seam.calls += 1
        if Seam.fail is not None:
            raise Seam.fail
        return PerQuestion(), dict, lambda: None

    monkeypatch.setattr(run_mod, "make_backend", make)
    return Seam


def run(tmp_path, ck, out, *extra) -> int:
    data = tmp_path / "qs.jsonl"
    if not data.exists():
        write_dataset(data)
    return cli.main(["run", "--model", str(ck), "--dataset", str(data), "--out", str(out), "--agents", "4",
                     "--limit", "0", "--methods", "svr-mad", *extra])


def last_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


# ---------------------------------------------------------------- row 2: a failed start leaves nothing behind

@pytest.mark.parametrize("flags, says", [
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--quantization", "native"], "quantization 'native' asked for, but the checkpoint is not quantized"),
])
def test_a_refused_start_leaves_the_folder_as_it_found_it(tmp_path, ck, loads, capsys, flags, says):
    out = tmp_path / "out"
    assert run(tmp_path, ck, out, *flags) == 2
    assert says in last_line(capsys)
    assert not out.exists() and loads.calls == 0
    out.mkdir()  # an existing, empty folder stays empty too
    assert run(tmp_path, ck, out, *flags) == 2
    assert list(out.iterdir()) == []
    assert run(tmp_path, ck, out) == 0  # the plain run is not refused
    assert set(state(out)["trace"]) == {"q1", "q3", "q4"}


def test_a_broken_model_refused_before_its_first_question_is_taken_over(tmp_path, ck, loads, capsys):
    out = tmp_path / "out"
    assert run(tmp_path, ck, out, "--model", str(tmp_path / "nope")) == 2
    assert not out.exists()
    loads.fail = ModelLoadError("out of memory while loading (simulated)")  # a failure only loading can find
    assert run(tmp_path, ck, out, "--agents", "5") == 2
    assert json.loads((out / "run.json").read_text())["config"]["agents"] == 5  # nothing saved, settings written
    loads.fail = None
    assert run(tmp_path, ck, out) == 0  # other settings, but no question was saved: taken over
    assert json.loads((out / "run.json").read_text())["config"]["agents"] == 4
    capsys.readouterr()
    assert run(tmp_path, ck, out, "--agents", "5") == 2  # now it holds questions: refused, naming the flag
    assert "--agents 4 in the folder, 5 now" in last_line(capsys)


# ---------------------------------------------------------------- row 10: the tokenizer, before any weight

def test_a_folder_without_a_tokenizer_is_refused_before_loading(tmp_path, ck, loads, capsys):
    for f in ck.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    assert run(tmp_path, ck, tmp_path / "out") == 2
    assert "has no tokenizer" in last_line(capsys)
    assert loads.calls == 0 and not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_chat_template_is_refused_before_loading(tmp_path, ck, loads, capsys):
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ck / "chat_template.jinja").unlink(missing_ok=True)
    assert run(tmp_path, ck, tmp_path / "out") == 2
    assert "has no chat template" in last_line(capsys)
    assert loads.calls == 0


def set_template(ck, template: str) -> None:
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ck / "chat_template.jinja").write_text(template)


@pytest.mark.parametrize("template, says", [
    # a template that only takes alternating turns starting with the user, as some do, but says so with a raise
    ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('Conversation roles must alternate "
     "user/assistant/user/assistant/...') }}{% endif %}{{ m.content }}{% endfor %}",
     "the chat template failed on messages (user, assistant, user): TemplateError: Conversation roles must alternate"),
    ("{% for m in messages %}{{ m.content }}", "TemplateSyntaxError: Unexpected end of template"),
    ("{{ messages[0].content / 2 }}", "the chat template failed on messages (user): TypeError"),
])
def test_a_chat_template_that_fails_is_refused_before_loading(tmp_path, ck, loads, capsys, template, says):
    """The template is rendered on the conversations a debate sends before any weight is read;
    a failure was a jinja2 traceback once the model had loaded."""
    set_template(ck, template)
    assert run(tmp_path, ck, tmp_path / "out") == 2
    line = last_line(capsys)
    assert line.startswith(f"svrmad run: {ck}: ") and says in line, line
    assert loads.calls == 0 and not (tmp_path / "out").exists()


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_loading(tmp_path, tiny_tokenizer, loads, capsys):
    """Every chat prompt holds the template's special tokens, the tokenizer's last ids: with fewer
    embeddings than tokens every question failed, one at a time."""
    from svrmad_local.models.loader import load_model

    from .conftest import make_model

    small = tmp_path / "small"
    make_model("llama", vocab=len(tiny_tokenizer) - 8, layers=1).save_pretrained(small)
    tiny_tokenizer.save_pretrained(small)
    says = f"the tokenizer in {small} has {len(tiny_tokenizer)} tokens but the model's vocabulary (config.json vocab_size) has {len(tiny_tokenizer) - 8}"
    assert run(tmp_path, small, tmp_path / "out") == 2
    assert says in last_line(capsys) and loads.calls == 0
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load_model(small, device="cpu")


@pytest.mark.parametrize("text, says", [
    ("{not json", "generation_config.json is not valid JSON"),
    ('{"max_new_tokens": -5}', "generation_config.json: `max_new_tokens` must be greater than 0, but is -5."),
    ("[1]", "generation_config.json is a JSON list, not an object"),
])
def test_a_bad_generation_config_is_named_before_loading(tmp_path, ck, loads, capsys, text, says):
    """transformers skips a generation_config.json that is not JSON (its eos ids silently go) and
    refuses a bad value only after the weights, as a failure to load them."""
    (ck / "generation_config.json").write_text(text)
    assert run(tmp_path, ck, tmp_path / "out") == 2
    line = last_line(capsys)
    assert f"{ck / 'generation_config.json'}" in line and says in line, line
    assert loads.calls == 0
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        check_folder(ck, device="cpu")


# ---------------------------------------------------------------- row 8: a device this torch cannot use

@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_line(tmp_path, ck, loads, capsys):
    assert run(tmp_path, ck, tmp_path / "out", "--device", "cuda") == 2
    line = last_line(capsys)
    assert "this torch" in line and "built without CUDA" in line and "download.pytorch.org" in line
    assert loads.calls == 0 and not (tmp_path / "out").exists()


def test_a_device_torch_does_not_know(monkeypatch):
    with pytest.raises(ModelLoadError, match="'gpu' is not a device torch knows"):
        check_device("gpu")
    check_device("cpu")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ModelLoadError, match=r"only 2 GPUs visible \(cuda:0 to cuda:1\)"):
        check_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ModelLoadError, match="has CUDA but sees no GPU"):
        check_device("cuda")


# ---------------------------------------------------------------- row 11: --run-ahead where it does nothing

@pytest.mark.parametrize("methods, noted", [(["self-consistency,group-debate,s2-mad", "--groups", "2-2"], True),
                                            (["all-to-all"], True), (["svr-mad,self-consistency"], False),
                                            (["sid-et"], False)])  # SID-ET records SVR-MAD to tune against
def test_run_ahead_says_when_it_has_no_effect(tmp_path, ck, loads, capsys, methods, noted):
    assert run(tmp_path, ck, tmp_path / "out", "--run-ahead", "--methods", *methods) == 0
    err = capsys.readouterr().err
    assert ("--run-ahead has no effect for" in err) == noted, err
