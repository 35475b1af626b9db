"""kernels.quant_triton (numpy interpreter) against float64 references written here from the format
definitions: MXFP4 (e2m1 codes, low nibble first, e8m0 scales per 32) and block-scaled FP8.

Tolerance: |out - ref| <= TOL[dtype] * max|ref| (+ a tiny absolute floor). fp32 inputs run an exact
(ieee) fp32 dot, so only summation order differs (1e-5); fp16/bf16 outputs are rounded once to their
dtype (bf16 has an 8-bit mantissa: 1e-2).
"""
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.kernels import quant_triton as qt  # noqa: E402

pytestmark = pytest.mark.usefixtures("interp")

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant_mxfp4_f64(blocks, scales):
    """[..., N, K/32, 16] uint8 + [..., N, K/32] -> float64 [..., N, K], straight from the format."""
    lut = torch.tensor(E2M1, dtype=torch.float64)
    lo, hi = lut[(blocks & 15).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # element 2j = low nibble of byte j
    vals = vals * torch.pow(2.0, scales.double() - 127)[..., None]
    return vals.flatten(-2)


def dequant_fp8_f64(weight, scale_inv, block):
    bn, bk = block
    n, k = weight.shape
    s = scale_inv.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.double() * s


def random_mxfp4(g, lead, n, k):
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, (*lead, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    bound = TOL[dtype] * ref.abs().max().item() + 1e-6
    assert err <= bound, f"max error {err} > {bound}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n,k,bias", [(1, 16, 32, False), (5, 23, 96, True), (17, 9, 64, False)])
def test_mxfp4_matmul(dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    blocks, scales = random_mxfp4(g, (), n, k)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = qt.mxfp4_matmul_triton(x, blocks, scales, b)
    ref = x.double() @ dequant_mxfp4_f64(blocks, scales).T + (b.double() if bias else 0)
    close(out, ref, dtype)


def test_mxfp4_every_code_and_extreme_scales():
    """All 16 codes in both nibbles, against the table; scales far from 127 (fp32 x: no range issue)."""
    codes = torch.arange(16, dtype=torch.uint8)
    byte = (codes[:, None] | (codes[None, :] << 4)).flatten()  # 256 bytes: every (lo, hi) pair
    blocks = byte.reshape(1, 16, 16).repeat(2, 1, 1)  # N=2, K=512
    scales = torch.tensor([[100, 127, 150, 1] * 4, [127] * 16], dtype=torch.uint8)
    w = dequant_mxfp4_f64(blocks, scales)
    assert w[1, :32].tolist() == [E2M1[j % 16] if i % 2 == 0 else E2M1[j // 16]
                                  for i, j in ((i, byte[i // 2].item()) for i in range(32))]
    x = torch.eye(512)[:3] + 0.25  # reads single weights back, plus a sum
    close(qt.mxfp4_matmul_triton(x, blocks, scales), x.double() @ w.T, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_grouped_matmul(dtype):
    g = torch.Generator().manual_seed(7)
    e, n, k = 5, 19, 64
    counts = [3, 0, 18, 1, 0]  # empty experts, one tile boundary crossed, a single row
    blocks, scales = random_mxfp4(g, (e,), n, k)
    bias = torch.randn(e, n, generator=g).to(dtype)
    m = sum(counts)
    x = torch.randn(m, k, generator=g).to(dtype)
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int64)
    out = qt.mxfp4_grouped_matmul_triton(x, offsets, blocks, scales, bias)
    w = dequant_mxfp4_f64(blocks, scales)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ w[i].T + bias[i].double() for i in range(e)])
    close(out, ref, dtype)
    out_nb = qt.mxfp4_grouped_matmul_triton(x, offsets.int(), blocks, scales)
    close(out_nb, ref - torch.cat([bias[i].double().expand(c, n) for i, c in enumerate(counts)]), dtype)


def test_mxfp4_grouped_single_row():
    g = torch.Generator().manual_seed(8)
    blocks, scales = random_mxfp4(g, (3,), 16, 32)
    x = torch.randn(1, 32, generator=g)
    out = qt.mxfp4_grouped_matmul_triton(x, torch.tensor([0, 0, 1, 1]), blocks, scales)
    close(out, x.double() @ dequant_mxfp4_f64(blocks, scales)[1].T, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n,k,block,bias", [
    (1, 16, 32, (16, 32), False),   # whole blocks, scale applied after the dot
    (3, 18, 40, (8, 16), True),      # ragged N and K: partial edge blocks; K tile spans blocks
    (17, 9, 70, (4, 64), False),     # ragged K inside one 64 block, scale after the dot
    (2, 33, 45, (12, 12), True),     # blocks dividing nothing
])
def test_fp8_matmul(dtype, m, n, k, block, bias):
    g = torch.Generator().manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = qt.fp8_matmul_triton(x, weight, scale_inv, block, b)
    ref = x.double() @ dequant_fp8_f64(weight, scale_inv, block).T + (b.double() if bias else 0)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [(8, 16), (16, 32)], ids=["tile-spans-blocks", "scale-after"])
def test_fp8_grouped_matmul(dtype, block):
    g = torch.Generator().manual_seed(9)
    e, n, k = 4, 19, 64
    counts = [3, 0, 18, 1]  # an empty expert, a tile boundary crossed, a single row
    weight = (torch.randn(e, n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(e, -(-n // block[0]), -(-k // block[1]), generator=g) * 0.02 + 1e-3
    m = sum(counts)
    x = torch.randn(m + 2, k, generator=g).to(dtype)  # two rows past offsets[E]: left unwritten
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)))
    out = qt.fp8_grouped_matmul_triton(x, offsets, weight, scale_inv, block)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ dequant_fp8_f64(weight[i], scale_inv[i], block).T
                     for i in range(e)])
    close(out[:m], ref, dtype)
    with pytest.raises(ValueError, match=r"needs scale_inv \[4, 3, 4\]"):
        qt.fp8_grouped_matmul_triton(x, offsets, weight, scale_inv[:, :2], (8, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_weights_read_as_bytes_give_the_same_bits(dtype, monkeypatch):
    """A GPU before sm_89 (an A100) has no e4m3 type in Triton: the kernels read the weight's bytes and
    decode them (`_e4m3`). Every finite code of the format decodes to torch's value (x the identity), and
    both kernels give the e4m3 path's bits, dense (scale after the dot, and spanning blocks) and grouped."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # e4m3fn's NaNs: a NaN times 0 would fill its column
    weight = codes.view(16, 16).view(torch.float8_e4m3fn)
    ones = torch.ones(1, 1)
    monkeypatch.setattr(qt, "FP8_BYTES", True)
    decoded = qt.fp8_matmul_triton(torch.eye(16), weight, ones, (16, 16)).T
    assert torch.equal(decoded, weight.float())
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(19, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    x = torch.randn(5, 64, generator=g).to(dtype)
    for block in ((16, 32), (8, 16)):
        s = torch.rand(-(-19 // block[0]), -(-64 // block[1]), generator=g) * 0.02 + 1e-3
        outs = {}
        for raw in (True, False):
            monkeypatch.setattr(qt, "FP8_BYTES", raw)
            outs[raw] = qt.fp8_matmul_triton(x, w, s, block)
        assert torch.equal(outs[True], outs[False]), block
    we, se = w.view(1, 19, 64).expand(2, -1, -1).contiguous(), torch.rand(2, 3, 4, generator=g) + 0.5
    offsets = torch.tensor([0, 2, 5])
    grouped = {}
    for raw in (True, False):
        monkeypatch.setattr(qt, "FP8_BYTES", raw)
        grouped[raw] = qt.fp8_grouped_matmul_triton(x, offsets, we, se, (8, 16))
    assert torch.equal(grouped[True], grouped[False])


def test_fp8_bytes_by_the_gpu():
    """Off a GPU the e4m3 type is used (the interpreter has it); FP8_BYTES unset."""
    assert qt.FP8_BYTES is None and qt.fp8_bytes("cpu") is False


def test_bad_shapes_are_one_line_errors():
    blocks, scales = random_mxfp4(torch.Generator().manual_seed(0), (), 4, 32)
    with pytest.raises(ValueError, match="x must be"):
        qt.mxfp4_matmul_triton(torch.randn(2, 64), blocks, scales)
    with pytest.raises(ValueError, match="scales"):
        qt.mxfp4_matmul_triton(torch.randn(2, 32), blocks, scales[:, :0])
    with pytest.raises(ValueError, match=r"blocks must be \[E, N, K/32, 16\]"):
        qt.mxfp4_grouped_matmul_triton(torch.randn(2, 32), torch.tensor([0, 2]), blocks, scales)
    with pytest.raises(ValueError, match="offsets"):
        qt.mxfp4_grouped_matmul_triton(torch.randn(2, 32), torch.tensor([0, 2]), blocks[None].repeat(2, 1, 1, 1),
                                       scales[None].repeat(2, 1, 1))
    w = torch.zeros(10, 20).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale_inv \[2, 1\]"):
        qt.fp8_matmul_triton(torch.randn(1, 20), w, torch.ones(1, 1), (8, 32))


def test_bench_quant_cpu_smoke():
    """benchmarks/bench_quant.py runs end to end on the CPU (tiny shapes, the Triton path through
    the interpreter), checking its paths agree, and prints its JSON line."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_quant.py"), "--cpu-smoke"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"rows"' in res.stdout.strip().splitlines()[-1]


# --- the tilings the GPUs take, at the paper's models' tile edges (small enough for the interpreter) ---
# GPT-OSS-120B's experts: hidden 2880 and intermediate 2880 (gate_up 5760 x 2880, down 2880 x 2880) are 22.5
# K tiles of 128 and 22.5 or 45 N tiles of 128 or 64: a 192 x 192 weight has the same half tiles. DeepSeek-V3.1's
# FP8 kv_a (576 x 7168) is 4.5 scale blocks of N (9 N tiles of 64) split over K at decode: 192 rows (1.5 blocks)
# split unevenly over a K of 7 blocks hit the same edges.
GPU_TILES = [qt.Tiles(16, 64, 128), qt.Tiles(16, 64, 128, split_k=2), qt.Tiles(16, 64, 128, split_k=3),
             qt.Tiles(64, 128, 64), qt.Tiles(128, 128, 64)]
TILE_IDS = ["decode", "decode-split2", "decode-split3", "mid", "prefill"]


@pytest.mark.parametrize("cfg", GPU_TILES, ids=TILE_IDS)
@pytest.mark.parametrize("m", [1, 5, 130])
def test_mxfp4_matmul_at_the_gpu_tilings(cfg, m):
    g = torch.Generator().manual_seed(m)
    blocks, scales = random_mxfp4(g, (), 192, 192)
    x = torch.randn(m, 192, generator=g)
    b = torch.randn(192, generator=g)
    ref = x.double() @ dequant_mxfp4_f64(blocks, scales).T + b.double()
    close(qt.mxfp4_matmul_triton(x, blocks, scales, b, cfg=cfg), ref, torch.float32)


@pytest.mark.parametrize("cfg", GPU_TILES + [qt.Tiles(16, 64, 32, split_k=5)], ids=TILE_IDS + ["decode-bk32-split5"])
@pytest.mark.parametrize("m", [1, 5, 130])
def test_fp8_matmul_at_the_gpu_tilings(cfg, m):
    g = torch.Generator().manual_seed(m + 1)
    n, k, block = 192, 7 * 128, (128, 128)
    weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 7, generator=g) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ dequant_fp8_f64(weight, scale_inv, block).T
    close(qt.fp8_matmul_triton(x, weight, scale_inv, block, cfg=cfg), ref, torch.bfloat16)


def _routed(g, tokens: int, experts: int, top: int):
    """Expert offsets of `tokens` routed to `top` of `experts` each (rows sorted by expert, some experts empty)."""
    picks = torch.stack([torch.randperm(experts - 2, generator=g)[:top] for _ in range(tokens)]).flatten()
    counts = torch.bincount(picks, minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]), int(counts.sum())


@pytest.mark.parametrize("cfg", [GPU_TILES[0], GPU_TILES[3], GPU_TILES[4]], ids=["decode", "mid", "prefill"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_grouped_matmuls_at_the_gpu_tilings(cfg, tokens):
    """GPT-OSS's 4 of 128 experts (MXFP4) and DeepSeek's 8 of 256 (FP8), scaled to 4 of 12 and 8 of 12 at the
    same tile edges: a decode step's single rows and a prefill chunk's partial row tiles, empty experts."""
    g = torch.Generator().manual_seed(tokens)
    e = 12
    offsets, m = _routed(g, tokens, e, 4)
    blocks, scales = random_mxfp4(g, (e,), 192, 192)
    bias = torch.randn(e, 192, generator=g)
    x = torch.randn(m, 192, generator=g)
    w = dequant_mxfp4_f64(blocks, scales)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ w[i].T + bias[i].double() for i in range(e)])
    close(qt.mxfp4_grouped_matmul_triton(x, offsets, blocks, scales, bias, cfg=cfg), ref, torch.float32)
    offsets, m = _routed(g, tokens, e, 8)
    weight = (torch.randn(e, 192, 256, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(e, 2, 2, generator=g) * 0.02 + 1e-3
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ dequant_fp8_f64(weight[i], scale_inv[i], (128, 128)).T
                     for i in range(e)])
    close(qt.fp8_grouped_matmul_triton(x, offsets, weight, scale_inv, (128, 128), cfg=cfg), ref, torch.bfloat16)


def test_the_tile_map_reads_the_offsets_once_and_bounds_the_grid():
    """Each row tile's (expert, first row, end) from one pass over the offsets; the grid's bound
    cdiv(M, BLOCK_M) + min(E, M) covers every tile, the rest marked -1."""
    offsets = torch.tensor([0, 3, 3, 21, 22, 22, 40], dtype=torch.int32)
    t, te, tr, tend = qt._tile_map(offsets, 6, 40, 16)
    assert t == 3 + 6
    assert te.tolist() == [0, 2, 2, 3, 5, 5, -1, -1, -1]
    assert tr[:6].tolist() == [0, 3, 19, 21, 22, 38] and tend[:6].tolist() == [3, 21, 21, 22, 40, 40]


def test_the_gpu_tiling_splits_narrow_decode_outputs_over_k():
    """At batch 1 on an H100 (132 SMs): DeepSeek's kv_a (576 x 7168, 9 column tiles) is split over K toward two
    programs an SM, as far as four K tiles a share allow (56 K tiles: 14 shares, 126 programs); a wide output (kv_b's 32768 rows) or a prefill chunk is not; the
    grouped GEMMs never split (their row tiles spread over the experts)."""
    kv_a = qt.gpu_tiles(1, 576, 7168, 16, 9, 132)
    assert (kv_a.block_m, kv_a.block_n, kv_a.split_k) == (16, 64, 14)
    assert qt._k_share(7168, kv_a) * kv_a.split_k >= 7168
    assert qt.gpu_tiles(1, 32768, 512, 16, 9, 132).split_k == 1
    assert qt.gpu_tiles(2048, 576, 7168, 16, 9, 132).split_k == 4
    assert qt.gpu_tiles(2048, 5760, 2880, 32, 9, 132).split_k == 1
    assert qt.gpu_tiles(1, 2880, 2880, 32, 9, 132, grouped=True).split_k == 1
    assert qt.gpu_tiles(4096, 5760, 2880, 32, 9, 132).block_m == 128
