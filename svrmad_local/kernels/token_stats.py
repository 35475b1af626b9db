"""Fused per-token statistics of the LM head: log-prob of a target, entropy, top-k, log-sum-exp.

The engine needs, for every generated/scored token, a handful of numbers derived from the
full-vocabulary softmax (``min_ll``, perplexity, mean entropy, top-k alternatives). Computing
``log_softmax(hidden @ weight.T)`` for all T tokens materialises a [T, V] fp32 tensor (4k tokens x
152k vocab = 2.5 GB, twice with the log_softmax output). Both paths here avoid that:

* ``kernel_impl="torch"``: rows are processed ``chunk_tokens`` at a time, so the fp32 logits only ever
  exist for one chunk ([chunk_tokens, V]).
* ``kernel_impl="triton"``: Cut-Cross-Entropy / Liger style. Each program owns a block of token rows and
  a slice ("split") of the vocabulary, loops over vocab tiles computing the matmul tile in
  registers and keeps an online log-sum-exp (running max ``m``, running ``sum exp(l - m)``, running
  ``sum exp(l - m) * l`` for the entropy), the target logit, and a running top-k set of packed
  (logit, id) int64 keys. Per-split partials ([splits, T] scalars plus [splits, T, k] candidates) are
  merged by a few torch ops. No logits leave the chip.

Entropy uses ``H = lse - sum_v p_v * l_v`` (since ``log p_v = l_v - lse``), which only needs the
running sums above.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._backend import HAS_TRITON, cdiv, fall_back, interpreting, next_pow2, resolve_impl, tl, triton
from .pdl import launch
from . import cpu_ops


class TokenStats(NamedTuple):
    """Per-token statistics, all fp32 except ``topk_ids`` (int64).

    ``logprob`` is ``None`` when no targets were given (a zero tensor would be mistaken for
    "probability 1"); targets outside ``[0, V)`` (e.g. -100 padding) get logprob 0.
    """

    logprob: Optional[torch.Tensor]  # [T]  log p(targets[t])
    entropy: torch.Tensor  # [T]  -sum_v p_v log p_v  (nats)
    topk_logprobs: torch.Tensor  # [T, k] sorted descending
    topk_ids: torch.Tensor  # [T, k] int64
    lse: torch.Tensor  # [T]  logsumexp of the (soft-capped) logits


def token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: Optional[torch.Tensor] = None,
                topk: int = 20, *, kernel_impl: str = "auto", chunk_tokens: int = 1024,
                softcap: Optional[float] = None) -> TokenStats:
    """Statistics of ``softmax(hidden @ weight.T)`` per token without a [T, V] fp32 tensor.

    hidden [T, H] (any float dtype; cast to ``weight.dtype`` first so both paths see the same
    inputs), weight [V, H] (LM head), targets [T] int or None. ``softcap`` applies Gemma-style
    ``c * tanh(logits / c)`` before the softmax. ``kernel_impl``: "torch" (chunked reference), "triton"
    (fused kernel) or "auto" (triton when importable and the tensors are on CUDA).
    ``chunk_tokens`` bounds the rows of fp32 logits alive at once in the torch path.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T,H] and weight [V,H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets is not None and targets.shape != hidden.shape[:1]:
        raise ValueError("targets must have shape [T]")
    if not 0 <= topk <= weight.shape[0]:
        raise ValueError(f"topk must be in [0, V={weight.shape[0]}]")
    if resolve_impl(kernel_impl, hidden.device, "token_stats") == "triton":
        try:
            return _token_stats_triton(hidden, weight, targets, topk, softcap)
        except Exception as err:
            fall_back("token_stats", err, kernel_impl)
    return _token_stats_torch(hidden, weight, targets, topk, chunk_tokens, softcap)


def reference_token_stats(hidden, weight, targets=None, topk=20, softcap=None) -> TokenStats:
    """Plain full-vocabulary log_softmax (materialises [T, V]); for tests only."""
    logits = hidden.to(weight.dtype).float() @ weight.float().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
    top = logp.topk(topk, dim=-1)
    lp = None
    if targets is not None:
        lp = _pick_target(logp, targets)
    return TokenStats(lp, entropy, top.values, top.indices, torch.logsumexp(logits, -1))


def _pick_target(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    valid = (targets >= 0) & (targets < logp.shape[1])
    picked = logp.gather(1, targets.clamp(0, logp.shape[1] - 1).long()[:, None])[:, 0]
    return torch.where(valid, picked, torch.zeros_like(picked))


def _token_stats_torch(hidden, weight, targets, topk, chunk_tokens, softcap) -> TokenStats:
    T, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    # One fp32 copy of the LM head ([V, H], independent of T) so logits are exact fp32 like the
    # kernel's fp32 accumulation; a no-op for fp32 weights.
    w = weight.float()
    lse = torch.empty(T, device=dev)
    entropy = torch.empty(T, device=dev)
    top_v = torch.empty(T, topk, device=dev)
    top_i = torch.empty(T, topk, dtype=torch.long, device=dev)
    lp = None if targets is None else torch.empty(T, device=dev)
    for s in range(0, T, max(1, chunk_tokens)):
        e = min(T, s + chunk_tokens)
        logp = hidden[s:e].to(weight.dtype).float() @ w.T  # [chunk, V]: the only big buffer...
        if softcap is not None:
            logp = torch.tanh(logp.div_(softcap)).mul_(softcap)
        lse[s:e] = torch.logsumexp(logp, -1)
        logp.sub_(lse[s:e, None])  # ...turned into log-probs in place
        if topk:
            top_v[s:e], top_i[s:e] = cpu_ops.topk(logp, topk)  # torch.topk's bits, compiled on the CPU
        if lp is not None:
            lp[s:e] = _pick_target(logp, targets[s:e])
        p = logp.exp()  # second (and last) [chunk, V] buffer
        entropy[s:e] = -p.mul_(logp).nan_to_num_(0.0).sum(-1)  # 0 * -inf -> 0
        del logp, p
    return TokenStats(lp, entropy, top_v, top_i, lse)


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------

def _unpack_keys(keys: torch.Tensor):
    """Inverse of ``_pack_key``: (fp32 logit, int64 vocab id)."""
    hi = (keys >> 32).to(torch.int32)
    vals = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).view(torch.float32)
    return vals, keys & 0xFFFFFFFF


if HAS_TRITON:
    from .pdl import enter

    @triton.jit
    def _pack_key(logit, idx):
        """Order-preserving int64 key: fp32 bits mapped to a monotone int32 (negative floats get
        their magnitude bits flipped) in the high word, the vocab id in the low word, so one
        integer max/compare carries the id along with the logit and every key is unique."""
        bits = logit.to(tl.int32, bitcast=True)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (mono.to(tl.int64) << 32) | idx.to(tl.int64)

    @triton.jit
    def _unpack_key(key):
        """Inverse of `_pack_key` in a kernel (as `_unpack_keys` on the host): (fp32 logit, the low word)."""
        hi = (key >> 32).to(tl.int32)
        return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), key & 0xFFFFFFFF

    @triton.jit
    def _update_topk(top, keys, K: tl.constexpr, KP: tl.constexpr):
        """Insert a tile of keys [BT, BV] into the running top-K set ``top`` [BT, KP] (unsorted;
        slots >= K unused). Only keys above a row's current K-th best can enter, so the loop runs
        as many times as the row needing most insertions: K on the first tile, usually 0-3 later.
        Each step moves the tile's best key into the slot holding the row's smallest one."""
        live = (tl.arange(0, KP) < K)[None, :]
        floor = tl.min(tl.where(live, top, 2**63 - 1), axis=1)
        n_new = tl.minimum(tl.sum((keys > floor[:, None]).to(tl.int32), axis=1), K)
        for _ in range(0, tl.max(n_new, axis=0)):
            best = tl.max(keys, axis=1)
            swap = live & (best > floor)[:, None] & (top == floor[:, None])
            top = tl.where(swap, best[:, None], top)
            keys = tl.where(keys == best[:, None], -(2**63), keys)
            floor = tl.min(tl.where(live, top, 2**63 - 1), axis=1)
        return top

    @triton.jit
    def _token_stats_kernel(
        X, W, TGT, M_OUT, S_OUT, A_OUT, TL_OUT, KEYS_OUT,
        T, V, H, split_size, softcap,
        s_xt, s_xh, s_wv, s_wh,
        HAS_TGT: tl.constexpr, HAS_CAP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, DO_TOPK: tl.constexpr,
        DOT_F32: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_t * BT + tl.arange(0, BT)
        rmask = rows < T
        v_lo = pid_s * split_size
        v_hi = tl.minimum(v_lo + split_size, V)
        if HAS_TGT:
            tgt = tl.load(TGT + rows, mask=rmask, other=-1)
        m = tl.full([BT], float("-inf"), tl.float32)
        s = tl.zeros([BT], tl.float32)
        a = tl.zeros([BT], tl.float32)
        t_logit = tl.zeros([BT], tl.float32)
        # distinct placeholders below every real key (keys are unique: the id is in the low word)
        top = tl.arange(0, KP)[None, :].to(tl.int64) + tl.full([BT, KP], -(2**63), tl.int64)
        for v0 in range(v_lo, v_hi, BV):
            cols = v0 + tl.arange(0, BV)
            cmask = cols < v_hi
            acc = tl.zeros([BT, BV], tl.float32)
            for h0 in range(0, H, BH):
                hs = h0 + tl.arange(0, BH)
                hmask = hs < H
                x = tl.load(X + rows[:, None] * s_xt + hs[None, :] * s_xh,
                            mask=rmask[:, None] & hmask[None, :], other=0.0)
                w = tl.load(W + cols.to(tl.int64)[:, None] * s_wv + hs[None, :] * s_wh,  # V*H may pass 2**31
                            mask=cmask[:, None] & hmask[None, :], other=0.0)
                if DOT_F32:  # fp32 weights (exact products), or bf16 under the interpreter
                    acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            if HAS_CAP:  # tanh(z) = 1 - 2 / (exp(2z) + 1), safe at both infinities
                acc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * acc / softcap) + 1.0))
            logit = tl.where(cmask[None, :], acc, float("-inf"))
            m_new = tl.maximum(m, tl.max(logit, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(logit - m_new[:, None])
            s = s * alpha + tl.sum(p, axis=1)
            a = a * alpha + tl.sum(p * tl.where(cmask[None, :], acc, 0.0), axis=1)
            m = m_new
            if HAS_TGT:
                t_logit += tl.sum(tl.where(cols[None, :] == tgt[:, None], logit, 0.0), axis=1)
            if DO_TOPK:
                keys = _pack_key(logit, cols[None, :] + tl.zeros([BT, BV], tl.int32))
                top = _update_topk(top, keys, K, KP)
        out = pid_s * T + rows
        tl.store(M_OUT + out, m, mask=rmask)
        tl.store(S_OUT + out, s, mask=rmask)
        tl.store(A_OUT + out, a, mask=rmask)
        if HAS_TGT:
            tl.store(TL_OUT + out, t_logit, mask=rmask)
        if DO_TOPK:
            kk = tl.arange(0, KP)
            tl.store(KEYS_OUT + out[:, None] * KP + kk[None, :], top, mask=rmask[:, None])


def _token_stats_triton(hidden, weight, targets, topk, softcap, split_size: int = 8192) -> TokenStats:
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    x = hidden.to(weight.dtype)
    if interpreting():  # numpy interpreter: small tiles keep the emulation fast
        BT, BV, BH = 16, 32, 32
    else:
        BT, BV, BH = 64, 64, 64
    KP = next_pow2(max(topk, 1))
    split_size = cdiv(max(split_size, BV), BV) * BV
    n_split = max(1, cdiv(V, split_size))
    m, s, a, tlog = (torch.empty(n_split, T, device=dev) for _ in range(4))
    keys = torch.empty(n_split, T, KP if topk else 1, dtype=torch.int64, device=dev)
    tgt = targets.to(device=dev, dtype=torch.int64).contiguous() if targets is not None else m
    dot_f32 = weight.dtype == torch.float32 or (interpreting() and weight.dtype == torch.bfloat16)
    warps = {} if interpreting() else {"num_warps": 8}  # [64, 64] int64 key tiles are register-heavy
    if T:
        _token_stats_kernel[(cdiv(T, BT), n_split)](
            x, weight, tgt, m, s, a, tlog, keys,
            T, V, H, split_size, float(softcap or 1.0),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            HAS_TGT=targets is not None, HAS_CAP=softcap is not None, K=max(topk, 1), KP=KP, DO_TOPK=topk > 0,
            DOT_F32=dot_f32, BT=BT, BV=BV, BH=BH, **warps, **launch(x),
        )
    # Merge the vocab splits: rescale every split's sums to the global max.
    m_all = m.max(0).values
    w = torch.exp(m - m_all)
    s_all = (s * w).sum(0)
    lse = m_all + torch.log(s_all)
    entropy = (lse - (a * w).sum(0) / s_all).clamp_min(0.0)
    lp = None
    if targets is not None:
        valid = (tgt >= 0) & (tgt < V)
        lp = torch.where(valid, tlog.sum(0) - lse, torch.zeros_like(lse))
    if topk:
        cand = keys.permute(1, 0, 2).reshape(T, n_split * KP)  # candidates of all splits
        vals, ids = _unpack_keys(cand.topk(topk, dim=1).values)  # keys sort like logits; sorted
        top_v, top_i = vals - lse[:, None], ids
    else:
        top_v, top_i = torch.empty(T, 0, device=dev), torch.empty(T, 0, dtype=torch.long, device=dev)
    return TokenStats(lp, entropy, top_v, top_i, lse)
