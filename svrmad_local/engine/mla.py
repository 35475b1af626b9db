"""Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, for the decode rows of a step.

The cache holds, per token and layer, the normalised KV latent c [kv_lora_rank] and the roped shared key
k_rot. transformers' DeepseekV3Attention expands the whole context through kv_b_proj before attention:
per head k_nope = W_UK c and v = W_UV c. Since q_nope . (W_UK c) = (q_nope W_UK) . c, a decode query can
instead be folded into latent space once (q_lat [H, kv_lora_rank]), attend to the cached latents
directly, and apply W_UV to the [H, kv_lora_rank] result: the cost is one read of the latent per step
instead of a [context, heads x 256] expansion in every layer (about 100x less work at a 16k context).

How a step uses it (EngineConfig.mla = "absorbed", the default): the cache hook writes the new latents
and hands the model nothing to expand: `install` makes each latent layer's `expand_kv` (transformers'
expansion through kv_b_proj, called right after the cache update in every release the adapter covers)
return empty stand-ins during the engine's steps, so no step expands anything the attention would not
read. `paged_attention` then computes the decode rows here, straight from the cache (kernels.mla_decode),
and the prefill runs with `prefill_attention`: each run's context expanded through kv_b_proj a bounded
chunk at a time (`chunk_slots`, PREFILL_CHUNK_BYTES of expanded keys and values), the chunks' partial
softmaxes merged by their log-sum-exps. A step over a 100k-token cached context at 128 heads would
otherwise ask for ~15 GB at once. "expanded" keeps transformers' computation for every row (the
reference: the whole context expanded in one call).
"""

from __future__ import annotations

import logging
import types
import weakref

import torch

from svrmad_local.kernels import merge_states
from svrmad_local.kernels.mla_decode import mla_decode
from svrmad_local.models.linear import dense_weight
from svrmad_local.models.plan import MLA_CHUNK_BYTES

from .context import get_context
from .kv_cache import BlockTables

log = logging.getLogger("svrmad_local")
MODES = ("absorbed", "expanded")
# The expanded keys and values of a prefill's context held at once, per layer: bounds the step's memory
# whatever the context's length (a parameter: a larger chunk is fewer, larger GEMMs); `svrmad plan`
# counts it in the profiled forward
PREFILL_CHUNK_BYTES = MLA_CHUNK_BYTES
# fp32 scores of one query block against one chunk, where attention runs in torch (the CPU)
SCORE_BYTES = 64 * 2**20


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mla must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _version_key(linear) -> tuple:
    """What identifies the current contents of a layer's weights without reading them: the storage
    and version counter of its first tensor (a weight reloaded or changed in place gets a new key)."""
    t = getattr(linear, "weight", None)
    if not torch.is_tensor(t):
        t = next(iter(list(linear.parameters()) + list(linear.buffers())), None)
    if t is None:
        return (id(linear),)
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = None
    try:
        where = t.data_ptr()
    except RuntimeError:  # a oneDNN-packed weight (models/linear.py) has no plain storage; packing is one-way
        where = id(t)
    return (where, version, t.device, t.dtype)


_absorbed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def absorbed_weights(module, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, C], W_UV^T [H, C, v]) split from `module.kv_b_proj`, computed once per weight
    version and kept beside the module (not in its state)."""
    proj = module.kv_b_proj
    key = (_version_key(proj), heads)
    hit = _absorbed.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    nope, vd = module.qk_nope_head_dim, module.v_head_dim
    w = dense_weight(proj)
    if w.shape[0] != heads * (nope + vd):
        raise ValueError(f"layer {module.layer_idx}: kv_b_proj has {w.shape[0]} output rows, expected "
                         f"{heads} heads x ({nope} + {vd})")
    w = w.detach().view(heads, nope + vd, w.shape[1])
    pair = (w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous())
    _absorbed[module] = (key, pair)
    return pair


def decode_attention(module, q: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor, tables: BlockTables,
                     block_size: int, scaling: float, kernel_impl: str = "auto") -> torch.Tensor:
    """Attention output [nd, H, v_head_dim] of the decode queries `q` [nd, H, nope + rope] (as the
    model hands them to the attention: cat(q_nope, q_rot)) against the latent cache of their layer."""
    heads, nope = q.shape[1], module.qk_nope_head_dim
    w_uk, w_uv_t = absorbed_weights(module, heads)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)  # [nd, H, C]
    out_lat = mla_decode(q_lat, q_rot, c_cache, kr_cache, tables.block_table, tables.lens, block_size, scaling,
                         kernel_impl=kernel_impl)  # [nd, H, C] fp32
    out = torch.bmm(out_lat.transpose(0, 1).to(w_uv_t.dtype), w_uv_t).transpose(0, 1)  # [nd, H, v]
    return out.to(q.dtype)


def latent_modules(model) -> list:
    """The model's latent attention modules (DeepSeek's: kv_b_proj expands the latent)."""
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_lora_rank")]


def heads_of(module) -> int:
    """The heads this rank's kv_b_proj expands (a tensor-parallel rank holds its share of the rows)."""
    proj = module.kv_b_proj
    rows = proj.weight.shape[0] if type(proj) is torch.nn.Linear else proj.out_features
    return rows // (module.qk_nope_head_dim + module.v_head_dim)


def chunk_slots(module, heads: int, dtype: torch.dtype, block_size: int, budget: int | None = None) -> int:
    """Context slots expanded at once in a prefill: as many whole blocks as keep kv_b_proj's output and
    the assembled keys of one chunk within `budget` (PREFILL_CHUNK_BYTES), at least one block."""
    item = torch.empty((), dtype=dtype).element_size()
    nope, rope, v = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    per_slot = heads * (2 * nope + rope + v) * item
    budget = PREFILL_CHUNK_BYTES if budget is None else budget
    return max(block_size, budget // per_slot // block_size * block_size)


def install(model) -> None:
    """Each latent layer's `expand_kv` returns stand-ins (no computation, no memory) while an engine step
    whose latent layers attend here (MLA absorbed) runs; elsewhere (transformers' own forwards, the spec
    probe, mla="expanded") it is the module's own. Once per module. A bound method, not a closure: a deep
    copy of the model (an fp32 truth made from it, say) then calls its own weights, not this module's."""
    for m in latent_modules(model):
        if "expand_kv" not in vars(m) and hasattr(m, "expand_kv"):
            m.expand_kv = types.MethodType(_stand_in, m)


def _stand_in(module, kv_nope, k_rot):
    paths = getattr(get_context(), "paths", None)
    if paths is None or not paths.mla_absorbed:
        return type(module).expand_kv(module, kv_nope, k_rot)
    b, _, n, _ = kv_nope.shape  # one head: the attention reads only the value width from it
    zero = kv_nope.new_zeros(())
    return (zero.expand(b, 1, n, module.qk_nope_head_dim + module.qk_rope_head_dim),
            zero.expand(b, 1, n, module.v_head_dim))


def prepare(model) -> None:
    """The absorbed weights of every latent layer, made now (build measures what they keep)."""
    for m in latent_modules(model):
        absorbed_weights(m, heads_of(m))


def expand(module, c: torch.Tensor, kr: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [n, H, nope + rope] and values [n, H, v] of latents c [n, C] and roped keys kr [n, R], as
    transformers' expand_kv computes them (kv_b_proj, whatever its packing)."""
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    kv = module.kv_b_proj(c).view(c.shape[0], heads, nope + v)
    k = kv.new_empty(c.shape[0], heads, nope + kr.shape[-1])
    k[..., :nope] = kv[..., :nope]
    k[..., nope:] = kr[:, None, :]
    return k, kv[..., nope:]


def prefill_attention(module, q: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor, runs: list,
                      block_size: int, scaling: float, out: torch.Tensor) -> None:
    """Writes into `out` [T, H, v] the attention of the prefill runs' rows of `q` [T, H, nope + rope] against
    their contexts in the latent cache. `runs`: the step's prefill Spans (rows [row0, row1) of q, `index`
    the context's slots, the run's new tokens last). Each context is expanded `chunk_slots` slots at a
    time: the cached part unmasked, the run's own tokens as causal squares with the rows after each
    square unmasked; the partial results are merged by their log-sum-exps, so no call holds more than
    a chunk of expanded keys and values, however long the context."""
    heads = q.shape[1]
    chunk = chunk_slots(module, heads, c_cache.dtype, block_size)
    c_cache, kr_cache = c_cache.reshape(c_cache.shape[0], -1), kr_cache.reshape(kr_cache.shape[0], -1)
    for r in runs:
        qn, index = r.row1 - r.row0, r.index
        start = index.shape[0] - qn
        qr = q[r.row0 : r.row1]
        acc = torch.zeros(qn, heads, module.v_head_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((qn, heads), float("-inf"), dtype=torch.float32, device=q.device)

        def part(k0: int, k1: int, *rows: tuple[int, int, bool]) -> None:
            """Keys k0..k1 of the context expanded once, attended by each (first row, end row, causal)."""
            k, v = expand(module, c_cache[index[k0:k1]], kr_cache[index[k0:k1]], heads)
            for a, b, causal in rows:
                o, l = _attend(qr[a:b], k, v, scaling, causal)
                acc[a:b], lse[a:b] = merge_states(acc[a:b], lse[a:b], o, l, kernel_impl="torch")

        for k0 in range(0, start, chunk):  # the cached context: every row sees all of it
            part(k0, min(k0 + chunk, start), (0, qn, False))
        for j0 in range(0, qn, chunk):  # the run's own tokens: a causal square, then the rows below it
            j1 = min(j0 + chunk, qn)
            part(start + j0, start + j1, (j0, j1, True), *([(j1, qn, False)] if j1 < qn else []))
        out[r.row0 : r.row1] = acc.to(out.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """(out fp32 [qn, H, Dv], lse fp32 [qn, H]) of q [qn, H, D] over k [n, H, D] and v [n, H, Dv], no mask
    or (`causal`, qn == n) the causal square. On CUDA, the memory-efficient kernel (different key and
    value widths, and the log-sum-exp); elsewhere fp32 scores a block of query rows at a time (at most
    SCORE_BYTES)."""
    if q.is_cuda:
        try:
            return _attend_cuda(q, k, v, scale, causal)
        except RuntimeError as err:  # an unsupported shape or dtype: the fp32 path, said once
            if not _warned:
                _warned.append(err)
                log.warning("svrmad: MLA prefill attention runs in fp32 torch ops (slower): the memory-efficient "
                            "kernel refused %s keys and %s values: %s", tuple(k.shape), tuple(v.shape),
                            str(err).splitlines()[0])
    return _attend_torch(q, k, v, scale, causal)


_warned: list = []


def _attend_cuda(q, k, v, scale: float, causal: bool):
    """`_attend` through torch's memory-efficient kernel (it takes values narrower than keys, and returns
    the log-sum-exp, padded to 32 queries)."""
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, causal,
        scale=scale)[:2]
    return o[0].transpose(0, 1).float(), lse[0, :, : q.shape[0]].transpose(0, 1)


def _attend_torch(q, k, v, scale: float, causal: bool):
    """`_attend` in fp32 torch ops, scores of a block of query rows at a time (at most SCORE_BYTES)."""
    qh, kh, vh = q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [H, ., D]
    H, qn, n = qh.shape[0], qh.shape[1], kh.shape[1]
    out = torch.empty(qn, H, vh.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(qn, H, dtype=torch.float32, device=q.device)
    rows = max(1, SCORE_BYTES // (4 * H * max(1, n)))
    for r0 in range(0, qn, rows):
        r1 = min(r0 + rows, qn)
        s = (qh[:, r0:r1] @ kh.transpose(1, 2)) * scale  # [H, r, n]
        if causal:
            s.masked_fill_(torch.ones(r1 - r0, n, dtype=torch.bool, device=q.device).triu(r0 + 1), float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        out[r0:r1] = ((p @ vh) / total).transpose(0, 1)
        lse[r0:r1] = (m + total.log()).squeeze(-1).transpose(0, 1)
    return out, lse
