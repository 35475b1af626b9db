"""The shared-memory arithmetic that picks the attention kernels' tiles (kernels/_backend.py): a config
whose tiles would exceed the device's shared memory fails to compile on the GPU (and "auto" used to hide
that behind the reference), so the tiles shrink until the estimate fits the H100's 227 KB."""

from __future__ import annotations

import pytest

from svrmad_local.kernels._backend import H100_SMEM, attn_smem, fit_attn_tiles


def test_the_estimate_counts_q_once_and_k_v_per_stage():
    # fp32, head dim 256, 64x64 tiles, 2 stages: Q 64x256, K and V 64x256 twice each, P 64x64
    assert attn_smem(64, 64, 256, 256, 4, stages=2) == 4 * (64 * 256 + 2 * 64 * 512 + 64 * 64) == 344064
    assert attn_smem(64, 64, 128, 128, 2, stages=3) == 2 * (64 * 128 + 3 * 64 * 256 + 64 * 64)


def test_fp32_head_dim_256_takes_smaller_key_tiles_on_an_h100():
    """The case that did not fit: paged prefill in fp32 with head_dim 256 asked for 64x64 tiles (about 336 KB)."""
    assert attn_smem(64, 64, 256, 256, 4) > H100_SMEM
    m, n = fit_attn_tiles(64, 64, 256, 256, 4, H100_SMEM)
    assert (m, n) == (64, 32) and attn_smem(m, n, 256, 256, 4) <= H100_SMEM


@pytest.mark.parametrize("d,elem", [(64, 2), (128, 2), (128, 4), (256, 2)])
def test_configs_that_fit_are_left_as_asked(d, elem):
    assert fit_attn_tiles(64, 64, d, d, elem, H100_SMEM) == (64, 64)


def test_the_key_tile_shrinks_first_then_the_query_tile_and_an_impossible_need_is_named():
    assert fit_attn_tiles(64, 64, 512, 512, 4, H100_SMEM) == (32, 16)
    assert fit_attn_tiles(16, 64, 256, 256, 4, 96 * 1024) == (16, 16)  # a query tile already small: keys shrink
    with pytest.raises(ValueError, match="head dims 1024/1024 need .* bytes of shared memory"):
        fit_attn_tiles(64, 64, 1024, 1024, 4, 100 * 1024)
