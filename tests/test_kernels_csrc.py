"""The C++ CPU kernels as real source files (svrmad_local/kernels/csrc/): each compiles with the flags
the builder uses (-fsyntax-only: nothing is written), a compile error is reported at its real file and
line (by the compile-only check and by a failed build alike), and the build's cache key follows the
files' contents, headers included."""

from __future__ import annotations

import platform
import shutil
import warnings

import pytest

from svrmad_local.kernels import _backend, _cpu_build, cpu_decode, cpu_linear, cpu_ops, cpu_stack  # noqa: F401  (defines the kernels)

KERNELS = {k.source.name: k for k in _cpu_build._KERNELS if k.source.parent == _cpu_build.CSRC}
NO_CXX = pytest.mark.skipif(_cpu_build.compiler() is None, reason="no C++ compiler on PATH")
BAD = '#include "simd.h"\n\nint answer() { return not_declared_anywhere; }\n'  # the error is on line 3


def test_every_source_file_belongs_to_one_kernel():
    assert sorted(KERNELS) == sorted(p.name for p in _cpu_build.CSRC.glob("*.cpp"))
    assert (_cpu_build.CSRC / "simd.h").is_file()


@NO_CXX
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_source_compiles_with_the_builders_flags(name):
    kernel = KERNELS[name]
    if kernel.needs_avx2 and _cpu_build.isa() not in ("avx2", "avx512"):
        pytest.skip(f"{name} needs AVX2 and the builder's flags here have none (torch sees {_cpu_build.isa()})")
    error = _cpu_build.check_syntax(kernel.source, kernel.extra_cflags)
    assert error is None, error


@NO_CXX
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_source_compiles_without_the_sections_above_avx2(name):
    """What a compiler without target pragmas (GCC < 11, clang < 12) builds: the AVX2 code alone."""
    kernel = KERNELS[name]
    if _cpu_build.isa() not in ("avx2", "avx512"):
        pytest.skip(f"the builder's flags here have no AVX2 (torch sees {_cpu_build.isa()})")
    error = _cpu_build.check_syntax(kernel.source, (*kernel.extra_cflags, "-DSVRMAD_NO_X86_TARGETS"))
    assert error is None, error


@NO_CXX
def test_a_kernel_whose_signature_moves_fails_to_compile_instead_of_being_called_wrongly(tmp_path):
    """cpu_stack.cpp calls the other kernels through their addresses; each module casts its functions to
    kernel_api.h's types, so a kernel given another parameter no longer compiles."""
    csrc = tmp_path / "csrc"
    shutil.copytree(_cpu_build.CSRC, csrc)
    source = csrc / "cpu_ops.cpp"
    text = source.read_text()
    old = "void silu_mul_into(torch::Tensor gate, torch::Tensor up, int64_t vec, torch::Tensor out) {"
    assert text.count(old) == 1
    source.write_text(text.replace(old, "void silu_mul_into(torch::Tensor gate, torch::Tensor up, int64_t vec, "
                                        "torch::Tensor out, int64_t extra = 0) {"))
    kernel = KERNELS["cpu_ops.cpp"]
    error = _cpu_build.check_syntax(source, kernel.extra_cflags)
    assert error is not None and "cpu_ops.cpp" in error, error


X86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="reads x86 assembly")
LOOP = """#include "simd.h"
#include <algorithm>
#include <vector>
static inline void rows(const char* p, int64_t n) {
  for (int64_t r = 0; r < n; ++r, p += 384)
    for (int64_t o = 0; o < 128; o += 64) PREFETCH(p + o);
}
struct Blocks {  // the decode kernel's prefetch of the blocks ahead, as it was
  std::vector<const char*> at;
  std::vector<int64_t> n;
  void ahead(size_t f, int64_t r0) const { if (f < n.size()) rows(at[f], std::min<int64_t>(8, n[f] - r0)); }
};
void ahead(const Blocks& b, size_t f) { b.ahead(f, 0); }
"""


@NO_CXX
@X86
def test_a_loop_of_nothing_but_prefetches_survives_the_optimiser(tmp_path):
    """GCC counts no side effect in __builtin_prefetch and may delete a loop made only of it, as a loop that
    does nothing: GCC 12 at -O1 and up deletes LOOP written with __builtin_prefetch, as it deleted the decode
    kernel's prefetch of the blocks ahead (2-core AVX-512 EPYC, 32 sequences of 48 keys in bf16: 10 GB/s
    read with it gone, 19 with it back). simd.h's prefetch_l2 is an asm statement, which it keeps."""
    src = tmp_path / "ahead.cpp"
    src.write_text(LOOP.replace("PREFETCH", "prefetch_l2"))
    assert "prefetcht1" in _cpu_build.assembly(src)


@NO_CXX
@X86
def test_the_decode_kernel_keeps_its_prefetches():
    """Four places prefetch (the first blocks' K and V, the K rows a block ahead, the V rows), in each of the
    three cache dtypes: at least twelve prefetch instructions (eight were left when the optimiser deleted them)."""
    if _cpu_build.isa() not in ("avx2", "avx512"):
        pytest.skip(f"the builder's flags here have no AVX2 (torch sees {_cpu_build.isa()})")
    assert _cpu_build.assembly(KERNELS["cpu_decode.cpp"].source).count("prefetcht1") >= 12


@NO_CXX
def test_the_compile_only_check_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text(BAD)
    error = _cpu_build.check_syntax(bad)
    assert error is not None and error.startswith(f"{bad}:3:"), error
    assert "not_declared_anywhere" in error


@NO_CXX
def test_a_failed_build_says_the_file_and_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text(BAD)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_cpu_build, "_KERNELS", [])  # keep the test kernel out of the engine's lists
    monkeypatch.setattr(_backend, "_CPU", dict(_backend._CPU))
    kernel = _cpu_build.Kernel("test_bad", bad, "SVRMAD_TEST_BAD", "test kernel")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert kernel.load() is None
    assert kernel.error.startswith(f"{bad}:3:") and "error" in kernel.error, kernel.error
    assert any(f"{bad}:3:" in str(w.message) for w in said if w.category is _cpu_build.KernelBuildWarning)
    assert _backend.choose("auto", "cpu", "test_bad") == _backend.KernelPick("torch", kernel.error)


def test_the_build_key_follows_every_file_and_the_flags(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(_cpu_build.CSRC, csrc)
    monkeypatch.setattr(_cpu_build, "CSRC", csrc)
    source, flags = csrc / "cpu_ops.cpp", ["-O3"]
    key = _cpu_build.digest(source, flags)
    assert _cpu_build.digest(source, flags) == key
    assert _cpu_build.digest(source, ["-O2"]) != key
    (csrc / "simd.h").write_text((csrc / "simd.h").read_text() + "\n// an edit\n")
    after_header = _cpu_build.digest(source, flags)
    assert after_header != key
    source.write_text(source.read_text() + "\n// an edit\n")
    assert _cpu_build.digest(source, flags) not in (key, after_header)


def test_first_error_reads_gcc_and_clang_lines():
    out = ("In file included from /x/a.cpp:1:\n/x/simd.h:12:5: warning: unused\n"
           "/x/a.cpp:40:17: error: 'y' was not declared in this scope\n/x/a.cpp:41:1: error: later\n")
    assert _cpu_build.first_error(out) == "/x/a.cpp:40:17: error: 'y' was not declared in this scope"
    assert _cpu_build.first_error("/x/a.cpp:2:10: fatal error: nope.h: No such file or directory") == \
        "/x/a.cpp:2:10: error: nope.h: No such file or directory"
    assert _cpu_build.first_error("ninja: build stopped") is None
