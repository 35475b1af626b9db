"""Run by tests/test_kernels_cpu_ops.py: an engine's worker thread whose end, as the OS runs it, comes after the
interpreter has begun to finalize, as a tensor-parallel follower's did in CI (its worker is let go only at the
interpreter's exit). The process must end with status 0, not abort.

The race, made certain: after the interpreter lets a thread go (its join returns), the thread still runs its
C++ thread_local destructors; here one that sleeps 0.2 s runs first. Meanwhile this thread holds the
interpreter's lock without asking anyone to switch, and lets it go only inside the interpreter's last
collection (`Late.__del__`): a destructor that takes the lock after that point ends its thread inside itself,
and the process aborts ("terminate called without an active exception")."""

import ctypes
import gc
import sys
import time

from svrmad_local.engine.engine import Engine, EngineConfig
from tests.conftest import make_model


class Late:
    def __del__(self):
        time.sleep(0.1)  # lets the interpreter's lock go, in its last collection


def main() -> None:
    # the static decode path: its probe step samples under graphs.HostSyncCheck, on the worker thread
    engine = Engine(make_model("llama"), None, EngineConfig(block_size=4, kv_cache_memory=2**20, cuda_graphs="static"))
    assert engine.runner.static is not None
    libc = ctypes.CDLL(None)
    usleep = ctypes.cast(libc.usleep, ctypes.c_void_p)
    # a thread_local destructor of the worker's, registered last: the first to run when the thread ends
    engine.on_worker(libc.__cxa_thread_atexit_impl, usleep, ctypes.c_void_p(200_000), None)
    sys.setswitchinterval(1000)  # a thread waiting for the lock does not ask for it: it gets it when let go
    print("built", flush=True)
    engine.close()
    engine._worker.join()  # the worker is done as far as Python knows; the OS thread sleeps in its destructors
    ctypes.PyDLL(None).usleep(500_000)  # the lock held meanwhile (PyDLL keeps it through the call)
    late = Late()
    late.me = late  # garbage only the interpreter's last collection frees
    gc.set_threshold(0)  # nothing prints from here: a write lets the lock go


if __name__ == "__main__":
    main()
