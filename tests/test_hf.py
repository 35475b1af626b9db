"""The transformers adapter (models/hf.py) under whichever release is installed: CI runs this file under
the highest and the lowest release of the range (.ci/run), so each seam is checked at both ends.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from svrmad_local.models import hf

from .model_zoo import EXACT, make_zoo_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", EXACT)
def test_every_layer_hands_its_cache_writes_to_the_cache_we_pass(name):
    """A wrong keyword is not an error in transformers (it lands in **kwargs and the layers build no
    cache), so this is the check that the engine's cache is the one every layer writes to."""
    from transformers import DynamicCache

    class RecordingCache(DynamicCache):  # transformers' own cache (its mask code asks it for lengths), watched
        def update(self, key, value, layer_idx, *args, **kwargs):
            self.seen.append(layer_idx)
            return super().update(key, value, layer_idx, *args, **kwargs)

    body = make_zoo_model(name).base_model
    cache = RecordingCache()
    cache.seen = []
    with torch.inference_mode():
        out = hf.run_body(body, torch.tensor([[3, 4, 5]]), torch.arange(3)[None], cache)
    assert sorted(cache.seen) == list(range(body.config.num_hidden_layers)), (name, hf.version())
    assert out.last_hidden_state.shape[:2] == (1, 3)


def test_the_cache_keyword_is_read_from_the_signature():
    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert hf.cache_kwarg(New) == "cache" and hf.cache_kwarg(Old) == "past_key_values"
    with pytest.raises(ValueError, match=r"^Neither.forward takes no cache .* under transformers \d"):
        hf.cache_kwarg(Neither)


def test_the_dtype_plan_casts_only_the_named_plain_tensors():
    """What from_pretrained keeps in fp32 when bf16 is asked, applied to a model built from a config; a
    packed (uint8) tensor under a matching name and every other weight stay as they are."""

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
            self.bias = torch.nn.Buffer(torch.zeros(2, dtype=torch.bfloat16))
            self.blocks = torch.nn.Buffer(torch.zeros(2, dtype=torch.uint8))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = Gate(), torch.nn.Linear(2, 2, dtype=torch.bfloat16)

        def _get_dtype_plan(self, dtype):
            return {"gate.weight": torch.float32, "gate.b*": torch.float32} if dtype == torch.bfloat16 else {}

    m = Model()
    hf.apply_dtype_plan(m, torch.bfloat16)
    assert isinstance(m.gate.weight, torch.nn.Parameter)
    assert {n: t.dtype for n, t in m.state_dict().items()} == {
        "gate.weight": torch.float32, "gate.bias": torch.float32, "gate.blocks": torch.uint8,
        "up.weight": torch.bfloat16, "up.bias": torch.bfloat16}
    fp32 = Model()
    hf.apply_dtype_plan(fp32, torch.float32)  # no plan for fp32: nothing moves
    assert fp32.gate.weight.dtype == torch.bfloat16


def test_quiet_restores_the_verbosity_even_after_an_error():
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    with pytest.raises(RuntimeError), hf.quiet():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        raise RuntimeError
    assert hf_logging.get_verbosity() == before


def test_the_chat_template_environment_parses_transformers_extensions():
    from jinja2 import meta

    template = "{% generation %}{{ x }}{% endgeneration %}"  # a plain jinja environment cannot parse this
    assert meta.find_undeclared_variables(hf.template_environment(template).parse(template)) == {"x"}


def test_the_installed_release_is_in_the_tested_range():
    assert _minor(hf.LOWEST) <= _minor(hf.version()) <= _minor(hf.HIGHEST), hf.version()


def test_the_pin_and_ci_state_the_adapters_range():
    """pyproject's pin is the adapter's range and CI's second run installs its lowest release."""
    pin = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins transformers as >=LOWEST,<NEXT"
    major, minor = _minor(hf.HIGHEST)
    assert (pin.group(1), pin.group(2)) == (hf.LOWEST, f"{major}.{minor + 1}")
    assert re.search(rf"^LOWEST={re.escape(hf.LOWEST)}\.0\b", (ROOT / ".ci" / "run").read_text(), re.M)


def _minor(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


def test_switching_a_configs_attention_takes_effect_and_restores():
    """engine/attention.Attachment flips a config's attention around each engine forward with these two."""
    config = make_zoo_model("llama").config
    before = hf.attn_implementation(config)
    hf.set_attn_implementation(config, "eager")
    assert config._attn_implementation == "eager"
    hf.set_attn_implementation(config, before)
    assert hf.attn_implementation(config) == before
