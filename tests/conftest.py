"""Tiny random-weight models and a tiny trained tokenizer, built locally so tests never need a hub."""

from __future__ import annotations

import os

# Triton kernels run on the CPU through its interpreter, which must be chosen before triton is first
# imported (torch._dynamo imports it during collection).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "What is 2 + 3? The answer is 5. Answer: \\boxed{5}",
    "These are the solutions to the problem from other agents: one agent solution.",
    "Using the solutions from other agents as additional information, provide your answer.",
    "Confidence: 80%. The final answer is (B). Let me think step by step about the question.",
    "Janet has 16 eggs and sells them for $2 each, so she makes 18 dollars every day.",
] * 5


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
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
