"""The Python API refuses what the command line refuses, in one line, when the settings are built
(SamplingParams, EngineConfig) or a request is made, never as a sampler RuntimeError, a
ZeroDivisionError or a KeyError further in; both read one set of checks (engine/config.py)."""

from __future__ import annotations

import math

import pytest

from svrmad_local.engine.config import EngineConfig, SamplingParams, SettingsError, SignalConfig
from svrmad_local.engine.engine import Engine, EngineClosed
from svrmad_local.errors import UserError
from svrmad_local.models.chat import ChatError

from .runharness import run


@pytest.mark.parametrize("kwargs, says", [
    ({"stop": ""}, "stop holds an empty string"),  # every text ends with "": one token, then "stop"
    ({"stop": ["x", ""]}, "stop holds an empty string"),
    ({"stop": ["x", 3]}, "stop must be a string or a list of strings"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),  # was 3 tokens
    ({"n": 2.5}, "n must be an integer, got 2.5"),
    ({"n": True}, "n must be an integer, got True"),
    ({"top_k": 4.0}, "top_k must be an integer, got 4.0"),
    ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature must be a finite number, got inf"),
    ({"top_p": math.nan}, "top_p must be a finite number, got nan"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"stop_token_ids": [2, -1]}, "stop_token_ids must be a list of token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
])
def test_sampling_params_are_checked_when_built(kwargs, says):
    with pytest.raises(SettingsError, match="invalid SamplingParams: ") as got:
        SamplingParams(**kwargs)
    assert says in str(got.value) and "\n" not in str(got.value)
    assert isinstance(got.value, UserError) and isinstance(got.value, ValueError)


def test_good_sampling_params_are_kept_as_given():
    p = SamplingParams(n=3, temperature=0, stop=("a", "b"), stop_token_ids=(7,), seed=-4)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [7] and p.greedy
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize("kwargs, says", [
    ({"block_size": 0}, "block_size must be >= 1, got 0"),  # was a ZeroDivisionError in the build
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),  # was blamed on kv_cache_memory
    ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens must be an integer"),
    ({"score_chunk": -1}, "score_chunk must be >= 1"),
    ({"kv_cache_memory": 1.5}, "kv_cache_memory 1.5: a fraction must be in (0, 1]"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory 'lots': expected bytes"),
    ({"signals": {"group_window": 8}}, "signals must be a SignalConfig"),
])
def test_engine_config_is_checked_when_built(kwargs, says):
    with pytest.raises(SettingsError, match="invalid EngineConfig: ") as got:
        EngineConfig(**kwargs)
    assert says in str(got.value)
    with pytest.raises(SettingsError, match="invalid SignalConfig: bottom_fraction must be in"):
        SignalConfig(bottom_fraction=0)


def test_the_command_line_says_the_same_with_its_flags(tmp_path, monkeypatch, capsys):
    from .runharness import use_script

    use_script(monkeypatch)
    assert run(tmp_path, tmp_path / "out", "--block-size", "0", "--max-tokens", "3") == 2
    assert capsys.readouterr().err.strip() == "svrmad run: --block-size must be >= 1, got 0"
    with pytest.raises(SettingsError, match="block_size must be >= 1, got 0"):
        EngineConfig(block_size=0)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4))
    yield eng
    eng.close()


def test_requests_are_checked_before_they_are_queued(engine):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    assert len(engine.generate_sync("2 + 3?", greedy)[0].completions[0].token_ids) == 2
    with pytest.raises(ChatError, match=r"message 1 has no 'content' \(keys: \['role'\]\)"):
        engine.generate_sync([[{"role": "user", "content": "hi"}, {"role": "assistant"}]], greedy)
    with pytest.raises(ChatError, match="message 0 has no 'role'"):
        engine.generate_sync([[{"content": "hi"}]], greedy)
    with pytest.raises(ChatError, match=r"message 0 \(user\): content must be text, token ids"):
        engine.generate_sync([[{"role": "user", "content": {"text": "hi"}}]], greedy)
    with pytest.raises(TypeError, match="takes its settings as a SamplingParams, got dict"):
        engine.generate_sync("hi", {"temperature": 0})
    engine.close()
    with pytest.raises(EngineClosed, match=r"this engine is closed \(close\(\) was called\)"):
        engine.generate_sync("2 + 3?", greedy)
    with pytest.raises(EngineClosed):
        engine.score_sync("2 + 3?", "5")


def test_from_pretrained_checks_its_settings_before_loading(tmp_path):
    with pytest.raises(SettingsError, match="block_size must be >= 1, got 0"):
        Engine.from_pretrained(tmp_path / "not-loaded", block_size=0)  # a missing folder would say so second
