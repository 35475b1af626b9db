"""Every Triton kernel of the package compiles for an H100/H200 (sm_90), here, without a GPU.

The CPU tests run the kernels in Triton's interpreter, which never compiles them; a GPU machine would
find a compile error only when it runs (and then fall back to the torch reference, slower, or fail a
graph's capture). tests/triton_compile.py runs the tests of TESTS with the interpreter's launches noted,
then compiles each distinct launch for sm_90 with Triton's own compiler and ptxas, specialized as the JIT
specializes it on a GPU (strides of 1 as constants, aligned pointers marked: what lets bf16 loads be
vectorized and pipelined). Every kernel of
svrmad_local/kernels (every jitted function named *_kernel) must be launched by those tests: a new
kernel that none of them runs fails here, named.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests that launch every kernel in each variant that compiles differently (its dtypes, its flags), chosen
# for their time from what all of the kernels' tests launch (about 40 s in the interpreter)
TESTS = [
    "tests/test_kernels_quant.py::test_fp8_matmul",
    "tests/test_kernels_quant.py::test_mxfp4_matmul",
    "tests/test_kernels_quant.py::test_fp8_grouped_matmul",
    "tests/test_kernels_quant.py::test_mxfp4_grouped_matmul",
    "tests/test_kernels_quant.py::test_fp8_weights_read_as_bytes_give_the_same_bits",
    "tests/test_kernels_fused_triton.py::test_add_rms_norm_adds_bitwise_and_norms_as_rms_norm",
    "tests/test_kernels_fused_triton.py::test_act_mul_reads_the_halves_of_one_gate_up_output",
    "tests/test_kernels_fused_triton.py::test_rope_store_is_the_reference_and_writes_only_its_slots",
    "tests/test_kernels_skinny.py::test_two_calls_give_the_same_bits",
    "tests/test_kernels_skinny.py::test_every_config_matches_the_reference_in_half_precision",
    "tests/test_kernels_skinny.py::test_every_config_matches_the_reference_in_fp32",
    "tests/test_kernels_skinny.py::test_the_gated_rows_are_act_muls_rows",
    "tests/test_kernels_skinny.py::test_the_normed_rows_are_add_rms_norms_rows",
    "tests/test_kernels_fused_triton.py::test_a_linears_unsummed_shares_norm_as_their_sum",
    "tests/test_kernels_skinny.py::test_a_tma_config_reads_the_tiles_its_pointer_twin_reads",
    "tests/test_kernels_paged_decode.py::test_triton_matches_the_torch_reference",
    "tests/test_kernels_paged_decode.py::test_out_is_written_in_place_whatever_its_strides",
    "tests/test_kernels_paged_decode.py::test_gqa_and_dtypes",
    "tests/test_kernels_paged_decode.py::test_windows_sinks_splits",
    "tests/test_kernels_paged_prefill.py::test_windows_and_sinks",
    "tests/test_kernels_paged_prefill.py::test_gqa_and_dtypes",
    "tests/test_kernels_mla.py::test_slots_no_token_wrote_never_reach_the_output",
    "tests/test_kernels_mla.py::test_triton_bf16_cache_close_to_float64",
    "tests/test_kernels_prefix_attention.py::test_attend_partial_triton_strided_query",
    "tests/test_kernels_prefix_attention.py::test_merge_states_is_exact",
    "tests/test_kernels_prefix_attention.py::test_attend_partial_window_per_row",
    "tests/test_kernels_prefix_attention.py::test_cascade_triton_three_levels",
    "tests/test_kernels_prefix_attention.py::test_cascade_window_triton",
    "tests/test_kernels_token_stats.py::test_triton_no_targets_no_topk_noncontiguous",
    "tests/test_kernels_token_stats.py::test_triton_matches_reference",
    "tests/test_kernels_token_stats.py::test_triton_many_vocab_splits_and_softcap",
    "tests/test_kernels_sample_pack.py::test_ties_at_the_top_take_the_first_id_and_order_by_id",
]


def kernels() -> set[str]:
    """The package's launchable Triton kernels: jitted functions whose names end in _kernel."""
    import svrmad_local.kernels as pkg

    found = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"svrmad_local.kernels.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                found.add(name)
    return found


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


def test_every_triton_kernel_compiles_for_the_gpus_architecture(tmp_path):
    if not _nvidia_backend():
        pytest.skip("Triton with its NVIDIA backend is not installed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    launches = tmp_path / "launches.json"
    rec = subprocess.run([sys.executable, "tests/triton_compile.py", "record", str(launches), *TESTS, "-x"],
                         cwd=ROOT, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=1200)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    recorded = {e["name"] for e in json.loads(launches.read_text())}
    assert kernels() - recorded == set(), "kernels none of TESTS launches: add a test that does to TESTS"
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "tests/triton_compile.py", "compile", str(launches), "--arch", "90"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == [], result["failed"]
    assert set(result["compiled"]) == recorded
    assert set(result["pdl"]) == recorded  # every kernel waits before it touches memory when launched with PDL
    # compiled as the JIT specializes them, every kernel's program fits an H100's 227 KB of shared memory
    assert set(result["shared"]) == recorded and max(result["shared"].values()) <= 227 * 1024, result["shared"]
    launches = json.loads(launches.read_text())
    assert any(e["ones"] for e in launches) and any(e["aligned"] for e in launches)
