"""What differs between the decoder families, read once from the model's module tree when the engine is
built: the decoder (engine/decoder.py) runs one layer loop for all of them over what this returns.

A family is named by its layer class. What a layer holds, in the order the loop uses it:
- norms: (weight, eps, style) triples. Gemma 3 scales by (1 + weight) and rounds like GPT-OSS after the
  weight (`fused.NormStyle`); Gemma 3 also norms the attention's and the MLP's outputs before their
  residual adds (its "sandwich" norms: `attn_out`, `mlp_out`).
- attention "kv": q/k/v as one GEMM where the linears were fused (models/linear.FusedGroup) or one
  projection holds them (Phi-3's qkv_proj); q/k norms (Qwen3, Gemma 3); the model's own `scaling`
  (Gemma 3's query_pre_attn_scalar); sinks (GPT-OSS); the layer's window (from the engine's spec);
  which rotary table (Gemma 3's local and global layers have their own); o_proj.
- attention "latent" (DeepSeek-V3's MLA): q_a/kv_a (one GEMM where fused), their norms, q_b, kv_b
  (expanded for prefill runs; absorbed for decode rows by engine/mla.py), interleaved RoPE or not.
- MLP "dense": gate/up as one GEMM (fused, or Phi-3's gate_up_proj), SiLU or GELU (tanh), down; or
  mixture of experts (Qwen3-MoE, GPT-OSS, DeepSeek-V3): the family's router, ported (`ROUTERS`: the
  model's formula, op for op), then the model's experts module, one call (for packed checkpoints our own
  models/quant experts), plus DeepSeek-V3's shared expert as a dense MLP.
RoPE's cos/sin are the model's own rotary module's (exact for every rope type it implements); GPT-OSS's
come half-width (its rotation pairs dimension j with j + D/2, as `rotate_half` does), so they are
doubled once a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from svrmad_local.kernels import cpu_linear, skinny
from svrmad_local.kernels.fused import CAST_LAST, GEMMA, PLAIN, NormStyle, Ops
from svrmad_local.models.layouts import PANELS, multiplies_dense

from .spec import LayerSpec

LAYERS = {"LlamaDecoderLayer": "llama", "MistralDecoderLayer": "mistral", "Qwen2DecoderLayer": "qwen2",
          "Qwen3DecoderLayer": "qwen3", "Phi3DecoderLayer": "phi3", "Gemma3DecoderLayer": "gemma3",
          "Qwen3MoeDecoderLayer": "qwen3-moe", "GptOssDecoderLayer": "gpt-oss",
          "DeepseekV3DecoderLayer": "deepseek-v3"}
NORMS = {"LlamaRMSNorm": PLAIN, "MistralRMSNorm": PLAIN, "Qwen2RMSNorm": PLAIN, "Qwen3RMSNorm": PLAIN,
         "Qwen3MoeRMSNorm": PLAIN, "Phi3RMSNorm": PLAIN, "DeepseekV3RMSNorm": PLAIN, "GptOssRMSNorm": CAST_LAST,
         "Gemma3RMSNorm": GEMMA}
DENSE_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Phi3MLP", "Gemma3MLP", "Qwen3MoeMLP", "DeepseekV3MLP"}
ACT_CLASSES = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
HALF_ROTARY = {"gpt-oss"}  # families whose rotary module returns cos/sin of D/2 (doubled for rotate_half)
SANDWICHED = {"gemma3"}  # families whose blocks' outputs pass a norm of their own before the residual add


class FastRMSNorm(nn.Module):
    """One of NORMS, computed by kernels/fused.py (the compiled op on the CPU: one call instead of eight
    ops); swapped in when our decoder runs, so the modules (a reference that runs the same model) compute
    the same norms. Keeps its weight under the same name: the model saves and reloads as before."""

    def __init__(self, norm: nn.Module, style: NormStyle, ops: Ops):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm_eps(norm)
        self.style, self.ops = style, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops if x.device == self.ops.device and x.dtype == self.ops.dtype else Ops(x.device, x.dtype)
        return ops.rms_norm(x, self.weight, self.variance_epsilon, self.style)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, {self.ops.impl}"


def norm_eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def norm_parts(norm: nn.Module) -> tuple[torch.Tensor, float, NormStyle]:
    """(weight, eps, style) of a norm module (the model's own, or its FastRMSNorm)."""
    style = norm.style if isinstance(norm, FastRMSNorm) else NORMS[type(norm).__name__]
    return norm.weight, norm_eps(norm), style


def swap_norms(model: nn.Module, ops: Ops) -> None:
    """Every norm of NORMS in `model` becomes a FastRMSNorm over the same weight (in place); one already
    swapped takes `ops` (a later engine's choice)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in NORMS:
                setattr(parent, name, FastRMSNorm(child, NORMS[type(child).__name__], ops))
            elif isinstance(child, FastRMSNorm):
                child.ops = ops


def linear_call(m: nn.Module, gemv: dict | None = None, unsummed: bool = False):
    """y [T, K] -> m(y): the panel kernel called directly where m holds panels (the same call its forward
    makes, without the module's and the layout's Python around it); for a plain nn.Linear whose shape
    `gemv` picked the skinny kernel at some row counts (engine/choices.py `gemv_choice`: {(N, K): {rows:
    Config}}), that kernel at those rows and F.linear at the others; else the module. `unsummed`: the
    output goes straight into an add + RMSNorm, so a split-K pick may return its partials for that norm to
    sum (kernels/shares.py)."""
    if holds_panels(m):
        return cpu_linear.bound(m.weight, m.out_features, m.bias)
    picks = gemv.get(tuple(m.weight.shape)) if gemv and multiplies_dense(m) else None
    if picks:
        return skinny.bound(m.weight, m.bias, picks, unsummed)
    return m


def holds_panels(m: nn.Module) -> bool:
    """Whether `m` keeps its weight as the panel kernel's panels (kernels/cpu_linear.py)."""
    return getattr(m, "layout", None) is PANELS and getattr(m, "packed", True)


def fused_group(linears: list[nn.Module]):
    """The fused group (models/linear.FusedGroup) whose parts `linears` are, in order; else None."""
    group = getattr(linears[0], "group", None)
    if group is not None and [getattr(m, "group", None) for m in linears] == [group] * len(linears) \
            and [m.i for m in linears] == list(range(len(group.bounds))):
        return group
    return None


def qkv_linears(attn: nn.Module) -> list[nn.Module]:
    """The projections that make q, k and v: Phi-3's one qkv_proj, else q_proj, k_proj, v_proj."""
    return [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]


def gate_up_linears(mlp: nn.Module) -> list[nn.Module]:
    """The projections that make gate and up: Phi-3's one gate_up_proj (gate first), else gate_proj, up_proj."""
    return [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]


def gemm_module(linears: list[nn.Module]) -> nn.Module | None:
    """The module whose one GEMM gives the outputs of `linears` (siblings reading one input, in order) side by
    side: a single linear, or the fused group (models/linear.FusedGroup) whose parts they are in order; else
    None."""
    return linears[0] if len(linears) == 1 else fused_group(linears)


def one_gemm(linears: list[nn.Module], sizes: list[int] | None = None):
    """(`gemm_module(linears)`, the cut of its output into theirs), or None: a fused group's output cut at its
    parts' bounds, one linear's into `sizes` column blocks (Phi-3's qkv_proj and gate_up_proj) or kept whole."""
    m = gemm_module(linears)
    if m is None:
        return None
    if sizes is not None:
        return m, lambda out: out.split(sizes, dim=-1)
    if len(linears) == 1:
        return m, lambda out: [out]
    cuts = [slice(lo, hi) for lo, hi in m.bounds]
    return m, lambda out: [out[:, c] for c in cuts]


def columns(linears: list[nn.Module], gemv: dict | None = None, sizes: list[int] | None = None):
    """A function y -> the outputs of `linears` (siblings reading y): one GEMM where `one_gemm` finds one,
    else one call each."""
    single = one_gemm(linears, sizes)
    if single is not None:
        mm, cut = linear_call(single[0], gemv), single[1]
        return lambda y: cut(mm(y))
    calls = [linear_call(m, gemv) for m in linears]
    return lambda y: [f(y) for f in calls]


def norm_in(ops: Ops, x, res, norm: tuple):
    """The decoder's norm before a block: (add_rms_norm(x, res), x + res), or (rms_norm(x), x) where there is
    no residual yet (the first layer)."""
    if res is None:
        return ops.rms_norm(x, *norm), x
    return ops.add_rms_norm(x, res, *norm)


NORMED = "norm"  # a linear's picks with the norm before it in its prologue: under (N, K, NORMED)


def normed_key(shape: tuple[int, int]) -> tuple[int, int, str]:
    """Where `gemv`'s picks hold the configs of a linear of weight shape (N, K) that computes the add + RMSNorm
    before it in its prologue (`normed_columns`): another kernel than the plain one, timed as such."""
    return (*shape, NORMED)


def normed_columns(norm: tuple, linears: list[nn.Module], gemv: dict | None = None, sizes: list[int] | None = None):
    """(x, res, ops) -> (the outputs of `linears` over the norm of x + res, the new residual): `norm_in`, then
    `columns`. Where `gemv` picked a normed config for their one GEMM's shape (under `normed_key`), at those
    row counts the skinny kernel computes the norm as it reads the rows (skinny.bound_normed: one launch for
    the two, the new residual written by it); everywhere else the two calls."""
    plain, single = columns(linears, gemv, sizes), one_gemm(linears, sizes)
    m = single[0] if single is not None else None
    picks = gemv.get(normed_key(tuple(m.weight.shape))) if gemv and m is not None and multiplies_dense(m) else None

    def two_calls(x, res, ops):
        y, res = norm_in(ops, x, res, norm)
        return plain(y), res

    if not picks:
        return two_calls
    fused, cut = skinny.bound_normed(m.weight, m.bias, picks, norm), single[1]

    def call(x, res, ops):
        done = fused(x, res)
        return two_calls(x, res, ops) if done is None else (cut(done[0]), done[1])

    call.picks = picks
    return call


def route_softmax_topk(router: nn.Module, h: torch.Tensor):
    """Qwen3-MoE: softmax over the experts (fp32), the top k, renormalised where the config says so."""
    logits = F.linear(h, router.weight)
    top, index = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), router.top_k, dim=-1)
    if router.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), index


def route_topk_softmax(router: nn.Module, h: torch.Tensor):
    """GPT-OSS: the top k logits (with the router's bias), softmax over those k."""
    top, index = torch.topk(F.linear(h, router.weight, router.bias), router.top_k, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype), index


def route_grouped_sigmoid(router: nn.Module, h: torch.Tensor):
    """DeepSeek-V3: sigmoid scores in fp32, chosen with the correction bias within the best groups (each
    group scored by its top two), weighted by the plain scores, renormalised, scaled."""
    scores = F.linear(h.type(torch.float32), router.weight.type(torch.float32)).sigmoid()
    choice = scores + router.e_score_correction_bias
    groups, per = router.num_group, router.num_experts // router.num_group
    group_scores = choice.view(-1, groups, per).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, per).reshape(-1, router.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    index = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * router.routed_scaling_factor, index


# mixture-of-experts block class -> (its router's attribute, the routing): transformers' formulas, ported
ROUTERS = {"Qwen3MoeSparseMoeBlock": ("gate", route_softmax_topk), "GptOssMLP": ("router", route_topk_softmax),
           "DeepseekV3MoE": ("gate", route_grouped_sigmoid)}
MOE_BLOCKS = set(ROUTERS)


class Dense:
    """A dense MLP's parts: gate/up as one GEMM where fused (or Phi-3's gate_up_proj), the activation, down,
    and `act_down(gate, up, act_mul)`: the activation times up, then down (`act_down_call`)."""

    __slots__ = ("gate_up", "norm_gate_up", "act", "down", "act_down")

    def __init__(self, m: nn.Module, gemv: dict | None = None, unsummed: bool = False, norm: tuple | None = None):
        """`norm`: the add + RMSNorm before the MLP (a dense layer's; a shared expert reads the routed rows'
        input): `norm_gate_up(x, res, ops)` runs the two (`normed_columns`)."""
        self.act = ACT_CLASSES[type(m.act_fn if hasattr(m, "act_fn") else m.activation_fn).__name__]
        linears = gate_up_linears(m)
        sizes = [linears[0].out_features // 2] * 2 if len(linears) == 1 else None  # Phi-3: one projection, gate first
        self.gate_up = columns(linears, gemv, sizes)
        self.norm_gate_up = normed_columns(norm, linears, gemv, sizes) if norm is not None else None
        self.down = linear_call(m.down_proj, gemv, unsummed)
        self.act_down = act_down_call(m, self.down, self.act, gemv, unsummed)


GATED = "silu"  # a down projection's gated picks are under (N, K, GATED) (engine/gemv.py times them apart)


def gated_key(shape: tuple[int, int]) -> tuple[int, int, str]:
    """Where `gemv`'s picks hold the configs of a down projection of weight shape (N, K) that computes
    SiLU(gate) * up in its prologue: another kernel than the plain one of that shape, timed as such."""
    return (*shape, GATED)


def silu_down(mlp: nn.Module) -> nn.Module | None:
    """The down projection of a dense MLP (or a shared expert) whose input is SiLU(gate) * up, which our
    decoder may run with the activation in the skinny kernel's prologue (`act_down_call`); else None."""
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    down = getattr(mlp, "down_proj", None)
    if ACT_CLASSES.get(type(act).__name__) != "silu" or not isinstance(down, nn.Module) or not multiplies_dense(down):
        return None
    return down


def act_down_call(mlp: nn.Module, call, act: str, gemv: dict | None = None, unsummed: bool = False):
    """(gate, up, act_mul) -> call(act_mul(gate, up, act)), `call` being down's `linear_call`. Where `gemv`
    picked a gated config for down (`silu_down`, under `gated_key`), at those row counts the kernel computes
    SiLU(gate) * up as it reads them (skinny.bound_gated: one launch instead of two, the same rows);
    everywhere else the two calls. `unsummed`: as `linear_call`'s."""
    down = silu_down(mlp)
    picks = gemv.get(gated_key(tuple(down.weight.shape))) if gemv and down is not None else None
    if picks:
        return skinny.bound_gated(down.weight, down.bias, picks, call, unsummed)
    return lambda gate, up, act_mul: call(act_mul(gate, up, act))


def shares_left(layer: nn.Module, family: str, sharded: bool) -> set[nn.Module]:
    """The linears of a decoder layer whose split-K skinny partials our decoder leaves unsummed for the add +
    RMSNorm after them to sum (kernels/shares.py): o_proj, and a dense MLP's down, where nothing stands between:
    no tensor-parallel all-reduce (it needs the sum), no norm of the block's output alone (SANDWICHED)."""
    if sharded or family in SANDWICHED:
        return set()
    dense = type(getattr(layer, "mlp", None)).__name__ in DENSE_MLPS
    return {layer.self_attn.o_proj} | ({layer.mlp.down_proj} if dense else set())


class Experts:
    """A mixture-of-experts layer's parts: the ported router (its module holds the weights), the model's
    experts module (called as a module: a tensor-parallel rank's expert mapping is its pre-hook), and
    DeepSeek-V3's shared expert."""

    __slots__ = ("router", "route", "experts", "shared")

    def __init__(self, m: nn.Module, gemv: dict | None = None):
        name, self.route = ROUTERS[type(m).__name__]
        self.router, self.experts = getattr(m, name), m.experts
        shared = getattr(m, "shared_experts", None)
        self.shared = Dense(shared, gemv) if shared is not None else None


class Layer:
    """One decoder layer's parts, read once (see the module docstring); the loop reads plain attributes."""

    __slots__ = ("index", "kind", "attn", "in_norm", "attn_out", "mlp_in", "mlp_out", "qkv", "q_norm", "k_norm",
                 "head_dim", "scaling", "sinks", "window", "rope", "o_proj", "latent", "dense", "moe")

    def __init__(self, layer: nn.Module, family: str, spec: LayerSpec, gemv: dict | None = None,
                 sharded: bool = False):
        """`sharded`: the weights are split for tensor parallelism (the blocks' outputs are all-reduced; a
        split-K skinny pick there sums its own partials: `shares_left`)."""
        a = layer.self_attn
        left = shares_left(layer, family, sharded)
        self.index, self.attn, self.kind = a.layer_idx, a, spec.kind
        self.window, self.scaling = spec.window, a.scaling
        self.in_norm = norm_parts(layer.input_layernorm)
        if family in SANDWICHED:  # norms around both blocks
            self.attn_out, self.mlp_out = norm_parts(layer.post_attention_layernorm), norm_parts(layer.post_feedforward_layernorm)
            self.mlp_in = norm_parts(layer.pre_feedforward_layernorm)
        else:
            self.attn_out = self.mlp_out = None
            self.mlp_in = norm_parts(layer.post_attention_layernorm)
        self.rope = getattr(a, "layer_type", None) if family == "gemma3" else None  # the rotary table it reads
        self.o_proj = linear_call(a.o_proj, gemv, a.o_proj in left)
        self.qkv = self.q_norm = self.k_norm = self.head_dim = self.sinks = self.latent = None
        if spec.kind == "latent":
            self.latent = Latent(a, gemv)
        else:
            self.head_dim = a.head_dim
            linears, sizes = qkv_linears(a), None
            if len(linears) == 1:  # Phi-3: one projection
                q = a.config.num_attention_heads * a.head_dim
                kv = (linears[0].out_features - q) // 2
                sizes = [q, kv, kv]
            self.qkv = normed_columns(self.in_norm, linears, gemv, sizes)  # (x, res, ops) -> ([q, k, v], res)
            if getattr(a, "q_norm", None) is not None:
                self.q_norm, self.k_norm = norm_parts(a.q_norm), norm_parts(a.k_norm)
            self.sinks = a.sinks if spec.sinks else None
        moe = type(layer.mlp).__name__ in MOE_BLOCKS
        self.moe, self.dense = (Experts(layer.mlp, gemv), None) if moe else \
            (None, Dense(layer.mlp, gemv, layer.mlp.down_proj in left, self.mlp_in))


class Latent:
    """DeepSeek-V3's multi-head latent attention parts: the query (through its LoRA q_a/q_b, or one
    q_proj), the compressed KV (kv_a: the latent and the shared RoPE key), their norms, kv_b."""

    __slots__ = ("module", "q_a_kv_a", "q_a_norm", "q_b", "q_proj", "kv_a", "kv_a_norm", "kv_b", "nope", "rope",
                 "rank", "v_dim", "interleave")

    def __init__(self, a: nn.Module, gemv: dict | None = None):
        self.module = a
        self.nope, self.rope, self.rank, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
        self.interleave = bool(getattr(a.config, "rope_interleave", False))
        self.q_a_kv_a = self.q_a_norm = self.q_b = self.q_proj = self.kv_a = None
        if a.q_lora_rank is not None:
            self.q_a_kv_a = columns([a.q_a_proj, a.kv_a_proj_with_mqa], gemv)
            self.q_a_norm, self.q_b = norm_parts(a.q_a_layernorm), linear_call(a.q_b_proj, gemv)
        else:
            self.q_proj, self.kv_a = linear_call(a.q_proj, gemv), linear_call(a.kv_a_proj_with_mqa, gemv)
        self.kv_a_norm, self.kv_b = norm_parts(a.kv_a_layernorm), linear_call(a.kv_b_proj, gemv)


def rope_latent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """DeepSeek's RoPE on x [T, heads, r] with cos/sin [T, r]: interleaved pairs (x0, x1), (x2, x3)...
    each rotated by one frequency (`rope_interleave`, its checkpoints' layout), in transformers' order of
    operations; else `rotate_half`'s pairing."""
    c, s = cos[:, None, :], sin[:, None, :]
    if not interleave:
        half = x.shape[-1] // 2
        return (x * c) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s)
    c, s = c[..., : c.shape[-1] // 2], s[..., : s.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# rope types whose cos/sin depend on the position alone: "dynamic" ones and "longrope" change with the longest
# position of the call (transformers' dynamic_rope_update), so they run the module at every step
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
ROPE_CHUNK = 256  # positions a module call while a table is filled
ROPE_TABLE_BYTES = 256 << 20  # the most a GPU's tables may take (Llama 3.1's 131,072 positions in bf16: 64 MiB)


class Rotary:
    """The step's cos/sin [T, r] from the model's own rotary module, per table a layer reads (one; Gemma 3
    one per layer type).

    On the CPU, where a rope type depends on the position alone, the module's rows for positions [0, n) are
    computed once (n doubling as positions grow) and a step reads its rows by index: the module's ~10 ops
    cost ~0.1 ms of a ~13 ms batch-1 bf16 step on a 2-core Xeon. The rows are the module's bits: each value
    is a product and a cos/sin of its own position, and the module's width is a multiple of 16, so at any
    number of positions a call computes every value in torch's vectorised loop (a width that is not would
    take its scalar tail for some, whose cos/sin may differ in the last bit: no table then).

    On a GPU a step cannot grow a table (reading pos.max() waits for the device, and a graph replays fixed
    kernels), so `prepare` fills every position the model takes once, at build: a step's ~10 kernels of the
    module become one index_select a table (`fixed`)."""

    def __init__(self, body: nn.Module, family: str, keys: set):
        self.module, self.keys, self.double = body.rotary_emb, sorted(keys, key=str), family in HALF_ROTARY
        types = getattr(self.module, "rope_type", None)
        types = list(types.values()) if isinstance(types, dict) else [types]
        self.tables: dict | None = {} if all(t in STATIC_ROPE for t in types) else None
        self.fixed = False  # the tables hold every position (prepare): a step reads them and never grows them

    def __call__(self, h: torch.Tensor, pos: torch.Tensor) -> dict:
        if self.tables is not None and (self.fixed or h.device.type == "cpu"):
            n, p, tables = None if self.fixed else int(pos.max()) + 1, pos[0], {}
            for key in self.keys:
                found = self.tables.get((key, h.dtype)) if self.fixed else self._table(key, h, n)
                if found is None:
                    break
                tables[key] = (found[0].index_select(0, p), found[1].index_select(0, p))
            else:
                return tables
        return {key: self._rows(key, h, pos) for key in self.keys}

    def prepare(self, dtype: torch.dtype, device: torch.device, positions: int) -> bool:
        """Tables of positions [0, positions) in `dtype` on `device`, made before any graph is captured and
        before the KV budget is measured (their memory is counted), and kept only where the module called
        as a step calls it (1, 8 and 37 positions: at the start, the end and between, in no order) gives
        their rows bit for bit; else the module runs every step, as before. False where no table is kept
        (a rope type that depends on more than the position, or tables over ROPE_TABLE_BYTES)."""
        if self.tables is None or positions < 1:
            return False
        h = torch.zeros(1, 1, 1, dtype=dtype, device=device)  # the module reads its dtype and device only
        width = self._rows(self.keys[0], h, torch.zeros(1, 1, dtype=torch.long, device=device))[0].shape[-1]
        if 2 * positions * width * h.element_size() * len(self.keys) > ROPE_TABLE_BYTES:
            return False
        g = torch.Generator().manual_seed(0)
        samples = [torch.arange(8), torch.tensor([positions - 1]), torch.randint(0, positions, (37,), generator=g)]
        made = {}
        for key in self.keys:
            table = self._whole(*self._fill(key, h, positions))
            for sample in samples:
                sample = sample.clamp_max(positions - 1).to(device)
                want = self._rows(key, h, sample[None])
                if not all(torch.equal(t.index_select(0, sample), w) for t, w in zip(table, want)):
                    return False
            made[(key, dtype)] = table
        self.tables.update(made)
        self.fixed = True
        return True

    def _rows(self, key, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._whole(*self._module(key, h, pos))

    def _module(self, key, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own cos/sin [T, w] for positions `pos` [1, T] (Gemma 3's for layer type `key`)."""
        cos, sin = self.module(h, pos) if key is None else self.module(h, pos, key)
        return cos[0], sin[0]

    def _whole(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's rows as a layer reads them: GPT-OSS's half-width ones doubled, contiguous."""
        if self.double:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.contiguous(), sin.contiguous()

    def _table(self, key, h: torch.Tensor, n: int):
        """cos/sin of positions [0, >= n) for `key` in h's dtype, or None where the module's width rules a table
        out (then `tables` is switched off)."""
        have = self.tables.get((key, h.dtype))
        if have is not None and have[0].shape[0] >= n:
            return have
        cos, sin = self._fill(key, h[:1, :1], max(ROPE_CHUNK, 1 << (n - 1).bit_length()))
        if cos.shape[-1] % 16:
            self.tables = None
            return None
        self.tables[(key, h.dtype)] = made = self._whole(cos, sin)
        return made

    def _fill(self, key, h: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's cos/sin [size, w] for positions [0, size), ROPE_CHUNK positions a call."""
        pos = torch.arange(size, device=h.device)[None]
        parts = [self._module(key, h, pos[:, i:i + ROPE_CHUNK]) for i in range(0, size, ROPE_CHUNK)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
