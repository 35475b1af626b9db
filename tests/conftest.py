"""Tiny random-weight models and a tiny trained tokenizer, built locally so tests never need a hub."""

from __future__ import annotations

import os

# Triton kernels run on the CPU through its interpreter, which must be chosen before triton is first
# imported (torch._dynamo imports it during collection).
os.environ.setdefault("TRITON_INTERPRET", "1")
# `--linear auto` keeps its fixed rule (the panels) in tests: tests that rely on the panels' batch-invariant
# arithmetic must not depend on what this machine measures; tests/test_calibrate.py turns it on.
os.environ.setdefault("SVRMAD_CALIBRATE", "0")
# The engine keeps torch's thread count in tests (EngineConfig.adapt_threads): a test that compares two runs
# bit for bit must not see a thread count the machine's load chose; tests/test_threads.py turns it on.
os.environ.setdefault("SVRMAD_ADAPT_THREADS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mimics of the reasoning templates (written from the public chat templates of openai/gpt-oss-20b,
# Qwen/Qwen3-8B and deepseek-ai/DeepSeek-V3.1): the same template variables, defaults, special tokens,
# generation prompts and treatment of earlier assistant turns; tools and system prompts left out.
HARMONY = (
    "{%- macro system_message() -%}"
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "{{- 'You are ChatGPT.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + reasoning_effort + '\n\n' }}"
    "{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- endmacro -%}"
    "{{- '<|start|>system<|message|>' + system_message() + '<|end|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
QWEN3 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\n') if '</think>' in m.content else m.content %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
DEEPSEEK_V31 = (
    "{%- if not thinking is defined %}{%- if enable_thinking is defined %}{%- set thinking = enable_thinking %}"
    "{%- else %}{%- set thinking = false %}{%- endif %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>', 1)[1] if '</think>' in m.content else m.content %}"
    "{{- '<｜Assistant｜></think>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{%- endif %}"
)
FAMILIES = {  # name -> (template, special tokens (id 2 = eos, as make_model's configs say), eos, bos, added tokens)
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|endoftext|>", []),
    "harmony": (HARMONY, ["<|endoftext|>", "<|start|>", "<|return|>", "<|end|>", "<|message|>", "<|channel|>",
                          "<|call|>"], "<|return|>", "<|endoftext|>", []),
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|endoftext|>",
              ["<think>", "</think>"]),
    "deepseek_v3.1": (DEEPSEEK_V31, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜end▁of▁sentence｜>", "<｜Assistant｜>"],
                      "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", ["<think>", "</think>"]),
}

_CORPUS = [
    "What is 2 + 3? The answer is 5. Answer: \\boxed{5}",
    "These are the solutions to the problem from other agents: one agent solution.",
    "Using the solutions from other agents as additional information, provide your answer.",
    "Confidence: 80%. The final answer is (B). Let me think step by step about the question.",
    "Janet has 16 eggs and sells them for $2 each, so she makes 18 dollars every day.",
] * 5
_REASONING_CORPUS = ["assistant analysis final commentary Reasoning: low medium high"] * 5


def build_tokenizer(family: str = "chatml"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, eos, bos, added = FAMILIES[family]
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_CORPUS + (_REASONING_CORPUS if family != "chatml" else []), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, bos_token=bos, pad_token=specials[0])
    tok.add_tokens(added)  # Qwen3's and DeepSeek's think tags are added tokens, not special ones
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


def make_model(arch: str = "llama", vocab: int = 400, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    cfg = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(head_dim=16, **common),
        "mistral": lambda: MistralConfig(sliding_window=None, **common),
    }[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random init is small; scale so the distribution is not flat and greedy ties are rare
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_model("llama", vocab=len(tiny_tokenizer))


@pytest.fixture
def interp():
    """Triton kernels on CPU tensors: only through the interpreter chosen above."""
    pytest.importorskip("triton")
    from svrmad_local.kernels._backend import interpreter_ready

    if not interpreter_ready():
        pytest.skip("triton was imported before TRITON_INTERPRET=1; "
                    "test_triton_cases_in_fresh_process runs these cases instead")
