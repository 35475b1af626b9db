"""svrmad-local: a local inference engine for multi-agent debate (SVR-MAD and its baselines).

    from svrmad_local import Engine, SamplingParams
    engine = Engine.from_pretrained("/models/Qwen3-8B", dtype="bf16", kv_cache_memory="40GiB")
    out = engine.generate_sync("What is 2 + 3?", SamplingParams(n=6, max_tokens=256))
"""

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "load_model"]


def __getattr__(name: str):
    """The public names, imported on first use (so `import svrmad_local` stays light)."""
    if name in ("Engine", "EngineConfig"):
        from svrmad_local.engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from svrmad_local.engine.params import SamplingParams

        return SamplingParams
    if name == "load_model":
        from svrmad_local.models.loader import load_model

        return load_model
    raise AttributeError(f"module 'svrmad_local' has no attribute {name!r}")
