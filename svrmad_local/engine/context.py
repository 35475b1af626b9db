"""The current step's context, per thread: what the model's forward hands to our hooks.

transformers calls `PagedKV.update` and `paged_attention` from deep inside its modules with only its
own arguments, so the engine parks the step's context here before the forward (`set_context`) and the
hooks read it back (`get_context`): an `attention.StepContext` for an engine step, or a `spec.Probe`
while `spec.inspect_model` probes the model (`probing`). Both attention.py and spec.py import this
module, and neither imports the other's runtime objects through it, so the dependency stays one-way
(spec -> context <- attention -> spec).
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


def set_context(ctx) -> None:
    _local.ctx = ctx


def get_context():
    """The StepContext or Probe set on this thread, or None outside the engine's forwards."""
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def probing(probe):
    set_context(probe)
    try:
        yield probe
    finally:
        set_context(None)
