"""Tiny random-weight configs of the architectures people debate with, built locally (no files, no hub).

Each entry is small enough for a CPU test, but keeps the feature that matters: sliding windows
shorter than the test prompts, GPT-OSS's sinks and alternating layers, DeepSeek-V3's latent
attention and MoE, Qwen3-MoE's experts, Gemma's scaled queries. `EXACT` lists the architectures the
engine must reproduce token for token; `REFUSED` maps the others to the refusal they must get.
"""

from __future__ import annotations

import random

import torch

WINDOW = 8  # shorter than every test prompt, so sliding layers really slide

_COMMON = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=0, pad_token_id=0,
               tie_word_embeddings=False)


def _config(name: str):
    from transformers import CONFIG_MAPPING as C

    c = dict(_COMMON)
    if name == "llama":
        return C["llama"](**c)
    if name == "qwen2":
        return C["qwen2"](**c)
    if name == "qwen2-sliding":  # layers >= max_window_layers slide (Qwen2's use_sliding_window)
        return C["qwen2"](use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **c)
    if name == "qwen3":
        return C["qwen3"](head_dim=16, **c)
    if name == "qwen3-moe":
        return C["qwen3_moe"](head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              decoder_sparse_step=1, **c)
    if name == "mistral-sliding":
        return C["mistral"](sliding_window=WINDOW, **c)
    if name == "phi3-sliding":
        return C["phi3"](sliding_window=WINDOW, **c)
    if name == "gemma3":  # local (sliding) and global layers, query_pre_attn_scalar scaling
        return C["gemma3_text"](head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24,
                                **c)
    if name == "gpt-oss":  # sinks on every layer, sliding and full layers alternating, MoE
        c.update(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
        return C["gpt_oss"](**c)
    if name == "deepseek-v3":  # multi-head latent attention, a dense first layer, then MoE
        c.update(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, rope_scaling=None)
        return C["deepseek_v3"](**c)
    if name == "gemma2":  # attention logit soft-capping
        return C["gemma2"](head_dim=16, sliding_window=WINDOW, **c)
    raise KeyError(name)


EXACT = ["llama", "qwen2", "qwen2-sliding", "qwen3", "qwen3-moe", "mistral-sliding", "phi3-sliding", "gemma3",
         "gpt-oss", "deepseek-v3"]
REFUSED = {"gemma2": r"Gemma2ForCausalLM \(gemma2\): attention logit soft-capping"}


def make_zoo_model(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)
    with torch.no_grad():  # random init is small: sharpen it so greedy ties are rare
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            elif "sinks" in n:
                p.normal_(0.0, 2.0)  # sinks that matter: some heads give the sink most of the mass
    return model.eval()


def rand_prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 400) for _ in range(n)]


@torch.no_grad()
def loop_greedy(model, prompt, n: int) -> list[int]:
    """The reference: no cache at all, the model's own attention, one full forward per token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=model.device), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def full_logprobs(model, tokens) -> torch.Tensor:
    """log_softmax of one plain forward, fp32, on the CPU."""
    logits = model(torch.tensor([tokens], device=model.device), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1).cpu()


def assert_cascade_matches_plain(make_engine, model, prompt, params, impl: str):
    """Forks decoded through the cascade kernels (`impl`) equal the plain path's, tokens and
    log-probs; returns the cascade engine for further checks."""
    import pytest

    plain = make_engine(model).generate_sync([prompt], params)[0]
    eng = make_engine(model, cascade="on", kernel_impl=impl)
    assert "cascade:" + impl in eng.info["attention"]
    got = eng.generate_sync([prompt], params)[0]
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in plain.completions]
    for a, b in zip(got.completions, plain.completions):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    return eng
