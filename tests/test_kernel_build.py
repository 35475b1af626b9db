"""Building the C++ CPU kernels (kernels/_cpu_build.py) cannot hang, can be stopped, and is named by all
that changes its output.

A kill during a build (SIGTERM, kill -9, the OOM killer) used to leave torch's build lock behind, and
every later run waited for it forever, silently; Ctrl-C during a build waited for the build to finish;
a ninja of another version on PATH rebuilt every kernel. Most tests here build a tiny pybind11 module
(seconds, not the minute a real kernel takes) in a fresh TORCH_EXTENSIONS_DIR, in fresh interpreters,
through a compiler wrapper that can be told to sleep first, so a kill lands inside the build."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from svrmad_local.kernels import _cpu_build

from .conftest import make_model

ROOT = Path(__file__).resolve().parents[1]
NO_CXX = pytest.mark.skipif(_cpu_build.compiler() is None or shutil.which("ninja") is None,
                            reason="no C++ compiler or ninja on PATH")
pytestmark = [NO_CXX, pytest.mark.skipif(sys.platform != "linux", reason="Linux processes and /proc")]

TINY = ('#include <pybind11/pybind11.h>\nint answer() { return 42; }\n'
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n')
LOAD = """
import sys, warnings
warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\\n"
from svrmad_local.kernels import _cpu_build
_cpu_build.WAIT_S = float(sys.argv[2])
kernel = _cpu_build.Kernel("test_tiny", sys.argv[1], "SVRMAD_TEST_TINY", "tiny test kernel")
mod = kernel.load()
print("answer", mod.answer() if mod is not None else None, "error", kernel.error)
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh extensions folder, the tiny source, and a compiler wrapper that sleeps $SLOW seconds before
    it compiles (its --version is the compiler's: the same toolchain whether it sleeps or not)."""
    real = _cpu_build.compiler()
    wrapper = tmp_path / "bin" / "cxx"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) sleep "${{SLOW:-0}}";; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(wrapper))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLOW": "0"}
    where = _cpu_build.build_dir(_cpu_build.module_name("test_tiny", src))
    return env, src, where


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_left():
    """A failed test leaves none of its processes running (their builds die with them)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def popen(argv: list[str], **kw) -> subprocess.Popen:
    STARTED.append(proc := subprocess.Popen(argv, cwd=ROOT, **kw))
    return proc


def start(env: dict, src: Path, wait_s: float = 600, **kw) -> subprocess.Popen:
    return popen([sys.executable, "-c", LOAD, str(src), str(wait_s)], env=env, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, **kw)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, list[str]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out, [line for line in err.splitlines() if line.strip()]


def wait_for(what, timeout: float = 300, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def lock_is_free(where: Path) -> bool:
    fd = os.open(where / _cpu_build.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_lock_a_killed_build_left_is_taken_over_in_one_line(env):
    env, src, where = env
    where.mkdir(parents=True, exist_ok=True)
    (where / "lock").touch()  # what torch's builder leaves when it is killed mid-build
    out, said = finish(start(env, src), timeout=240)
    assert "answer 42" in out
    assert len(said) == 1 and said[0] == f"warning: removed the build lock a killed build of the tiny test kernel " \
                                          f"left in {where}", said


def test_kill_9_mid_build_then_the_next_run_completes(env):
    """The build's child dies with its parent (the compiler under it too), and the next run takes the
    dead build's lock over in one line."""
    env, src, where = env
    first = start({**env, "SLOW": "300"}, src)
    wait_for(lambda: (where / "build.ninja").exists() or first.poll() is not None)
    time.sleep(0.5)  # the compiler wrapper is asleep now
    first.kill()
    first.wait()
    wait_for(lambda: lock_is_free(where), timeout=10)  # the orphaned build is gone: it held the lock
    out, said = finish(start(env, src), timeout=240)
    assert "answer 42" in out
    assert len(said) <= 1 and all("removed the build lock a killed build" in line for line in said), said


def test_a_live_build_is_waited_for_in_one_line_and_at_most_wait_s(env, tmp_path):
    env, src, where = env
    where.mkdir(parents=True, exist_ok=True)
    fd = os.open(where / _cpu_build.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's build, alive
        os.write(fd, b"4242")
        out, said = finish(start(env, src, wait_s=2), timeout=120)  # gives up after its bound
        assert "answer None" in out and "held the build lock" in out
        assert len(said) == 2, said
        assert said[0] == (f"warning: another process (pid 4242) is building the tiny test kernel in {where}: "
                           "waiting for it (at most 2 s)")
        assert said[1].startswith("warning: the tiny test kernel did not build (TimeoutError: process 4242 held")
        log = tmp_path / "waiting.err"
        with open(log, "w") as err:  # this one's holder finishes while it waits: it goes on and builds
            waiting = popen([sys.executable, "-c", LOAD, str(src), "600"], env=env, stdout=subprocess.PIPE, stderr=err,
                            text=True)
        wait_for(lambda: "waiting for it" in log.read_text() or waiting.poll() is not None)
    finally:
        os.close(fd)
    out, _ = waiting.communicate(timeout=240)
    said = [line for line in log.read_text().splitlines() if line.strip()]
    assert waiting.returncode == 0 and "answer 42" in out and len(said) == 1 and "waiting for it" in said[0], said


def test_the_build_name_covers_the_toolchain(tmp_path, monkeypatch):
    """Two ninjas (a venv's and the system's), two compilers or two torch releases: two builds, each
    kept; the same toolchain: the same build."""
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    real_ninja = shutil.which("ninja")

    def tool(name: str, version: str, real: str) -> Path:
        d = tmp_path / f"{name}-{version}"
        d.mkdir()
        (d / name).write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo {version}; exit 0; }}\nexec {real} "$@"\n')
        (d / name).chmod(0o755)
        return d / name

    path = os.environ["PATH"]
    names = {}
    for version in ("1.11.1", "1.13.2"):
        monkeypatch.setenv("PATH", f"{tool('ninja', version, real_ninja).parent}{os.pathsep}{path}")
        names[f"ninja {version}"] = _cpu_build.module_name("test_tiny", src)
        assert _cpu_build.module_name("test_tiny", src) == names[f"ninja {version}"]  # stable
    monkeypatch.setenv("PATH", path)
    real_cxx = _cpu_build.compiler()
    for version in ("12.2.0", "13.3.0"):
        monkeypatch.setenv("CXX", str(tool("c++", version, real_cxx)))
        names[f"c++ {version}"] = _cpu_build.module_name("test_tiny", src)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(_cpu_build.torch, "__version__", "0.0.0+other")
    names["torch"] = _cpu_build.module_name("test_tiny", src)
    assert len(set(names.values())) == len(names), names


def test_two_ninjas_keep_a_build_each(env, tmp_path):
    """Built under one ninja, then another, then the first again: the third run imports the first build
    (nothing runs: no child, no compiler)."""
    env, src, _ = env
    real_ninja = shutil.which("ninja")
    paths = []
    for version in ("1.11.1", "1.13.2"):
        d = tmp_path / f"ninja-{version}"
        d.mkdir()
        (d / "ninja").write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo {version}; exit 0; }}\n'
                                 f'exec {real_ninja} "$@"\n')
        (d / "ninja").chmod(0o755)
        paths.append(f"{d}{os.pathsep}{env['PATH']}")
    for path in paths:
        out, said = finish(start({**env, "PATH": path}, src))
        assert "answer 42" in out and not said
    builds = sorted(p.parent for p in Path(env["TORCH_EXTENSIONS_DIR"]).glob(f"svrmad_test_tiny_*/{_cpu_build.DONE}"))
    assert len(builds) == 2
    before = {p: p.stat().st_mtime_ns for b in builds for p in b.iterdir()}
    out, said = finish(start({**env, "PATH": paths[0], "SLOW": "300"}, src), timeout=60)  # a build would sleep
    assert "answer 42" in out and not said
    assert {p: p.stat().st_mtime_ns for b in builds for p in b.iterdir()} == before


# -- the engine's first start: Ctrl-C and kill -9 during its builds --------------------------------------


@pytest.fixture
def tiny_run(tmp_path, tiny_tokenizer):
    """`svrmad run` over a tiny checkpoint and two questions, with its own extensions and cache folders."""
    ck = tmp_path / "model"
    make_model("llama", vocab=len(tiny_tokenizer), seed=3).save_pretrained(ck)
    tiny_tokenizer.save_pretrained(ck)
    data = tmp_path / "qs.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + 1?", "gold": str(i + 1),
                                        "answer_type": "math"}) + "\n" for i in range(2)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "SVRMAD_CACHE": str(tmp_path / "cache"), "SLOW": "0"}

    def argv(out: str) -> list[str]:
        return [sys.executable, "-m", "svrmad_local", "run", "--model", str(ck), "--dataset", str(data), "--out",
                str(tmp_path / out), "--max-tokens", "6", "--agents", "2", "--methods", "svr-mad", "--device", "cpu",
                "--kv-cache-memory", "4MiB", "--block-size", "4", "--limit", "0"]

    return env, argv, tmp_path / "ext"


def test_ctrl_c_during_the_kernel_build_exits_at_once(tiny_run, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while the engine's worker builds a kernel: the run
    says it was interrupted and exits in seconds (it used to wait for the build: 54-78 s), leaving no
    build running and no lock behind."""
    env, argv, ext = tiny_run
    wrapper = tmp_path / "bin" / "cxx"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) sleep 300;; esac\nexec {_cpu_build.compiler()} "$@"\n')
    wrapper.chmod(0o755)
    proc = popen(argv("interrupted"), env={**env, "CXX": str(wrapper)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, start_new_session=True)
    wait_for(lambda: any(ext.glob("*/build.ninja")) or proc.poll() is not None)
    time.sleep(1)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and "svrmad run: interrupted" in err, err[-3000:]
    assert took < 20, f"exited {took:.0f} s after Ctrl-C"
    assert "Traceback" not in err, err[-3000:]
    for build in ext.glob("*/build.ninja"):
        assert lock_is_free(build.parent) and not (build.parent / "lock").exists()


def kernel_dirs() -> dict[str, Path]:
    """Each engine kernel's finished build in the default extensions folder (built here first if needed)."""
    out = {}
    for kernel in _cpu_build._KERNELS:
        if kernel.source.parent == _cpu_build.CSRC and kernel.load() is not None:
            out[kernel.name] = _cpu_build.build_dir(_cpu_build.module_name(kernel.name, kernel.source,
                                                                          kernel.extra_cflags))
    return out


# (a sitecustomize for the killed run only) the calibration's first timing says so and waits to be killed
HOLD_CALIBRATION = """
import sys, time
from svrmad_local.models import calibrate
_time_step = calibrate.time_step
def time_step(*args, **kw):
    print("timing a linear shape", file=sys.stderr, flush=True)
    time.sleep(600)
    return _time_step(*args, **kw)
calibrate.time_step = time_step
"""


@pytest.mark.parametrize("point", ["cpu_decode", "cpu_linear", "cpu_ops", "cpu_stack", "calibration"])
def test_kill_9_at_each_point_of_the_first_start_then_a_run_completes(tiny_run, point, monkeypatch):
    """kill -9 of `svrmad run` during one kernel's build (every other kernel built) or during the linear
    calibration (every kernel built), then the same run again: it completes, with at most one line
    about what it cleaned up."""
    from svrmad_local.kernels import cpu_decode, cpu_linear, cpu_ops, cpu_stack  # noqa: F401  (defines the kernels)

    env, argv, ext = tiny_run
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    built = kernel_dirs()
    if point != "calibration" and point not in built:
        pytest.skip(f"the {point} kernel does not build here")
    for name, where in built.items():
        if name != point:
            shutil.copytree(where, ext / where.name, ignore=shutil.ignore_patterns(_cpu_build.LOCK))
    env = {**env, "SVRMAD_CALIBRATE": "1" if point == "calibration" else "0"}
    killed_env = env
    if point == "calibration":  # a tiny model's calibration takes well under a second: hold it at its first timing
        hold = ext.parent / "hold"
        hold.mkdir(exist_ok=True)
        (hold / "sitecustomize.py").write_text(HOLD_CALIBRATION)
        killed_env = {**env, "PYTHONPATH": f"{hold}{os.pathsep}{env['PYTHONPATH']}"}
    proc = popen(argv("killed"), env=killed_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.set_blocking(proc.stderr.fileno(), False)
    seen = bytearray()

    def calibrating() -> bool:
        seen.extend(proc.stderr.read() or b"")
        return b"timing a linear shape" in seen or proc.poll() is not None

    if point == "calibration":
        wait_for(calibrating)
    else:
        where = ext / built[point].name
        wait_for(lambda: (where / "build.ninja").exists() or proc.poll() is not None)
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before the kill"
    proc.kill()
    proc.wait()
    if point == "calibration":
        assert not list((Path(env["SVRMAD_CACHE"]) / "calibration").glob("*.json")), "the kill came too late"
    done = subprocess.run(argv("killed"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "lock" in line or "clean" in line or "removed" in line]
    assert len(said) <= 1, said
    assert "Traceback" not in done.stderr
