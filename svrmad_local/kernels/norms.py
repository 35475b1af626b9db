"""What the fused ops' implementations share (kernels/fused.py, kernels/fused_triton.py): how a family's
RMSNorm rounds and scales, and the activations act_mul takes. A module of its own so that the Triton
kernels read these without importing the interface that chooses them."""

from __future__ import annotations

from dataclasses import dataclass

ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class NormStyle:
    """How a family's RMSNorm rounds and scales: `offset` 1 scales by (1 + weight) (Gemma stores w - 1);
    `cast_last` multiplies by the weight in fp32 and casts after (Gemma, GPT-OSS), else casts the
    normalised row to the input's dtype first (Llama and most). The same thing in fp32."""

    offset: float = 0.0
    cast_last: bool = False


PLAIN = NormStyle()  # Llama, Mistral, Qwen2/3, Qwen3-MoE, Phi-3, DeepSeek-V3: weight * norm(x).to(dtype)
CAST_LAST = NormStyle(cast_last=True)  # GPT-OSS: (weight * norm(x)).to(dtype)
GEMMA = NormStyle(offset=1.0, cast_last=True)  # Gemma 3: (norm(x) * (1 + weight.float())).to(dtype)
