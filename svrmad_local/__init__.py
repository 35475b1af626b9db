"""svrmad-local: a local inference engine for multi-agent debate (SVR-MAD and its baselines).

    from svrmad_local import Engine, SamplingParams
    engine = Engine.from_pretrained("/models/Qwen3-8B", dtype="bf16", kv_cache_memory="40GiB")
    out = engine.generate_sync("What is 2 + 3?", SamplingParams(n=6, max_tokens=256))
"""

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "load_model"]


def __getattr__(name: str):
    """The public names, imported on first use (so `import svrmad_local` stays light)."""
    if name == "Engine":
        from svrmad_local.engine.engine import Engine

        return Engine
    if name in ("EngineConfig", "SamplingParams"):
        from svrmad_local.engine import config

        return getattr(config, name)
    if name == "load_model":
        from svrmad_local.models.loader import load_model

        return load_model
    raise AttributeError(f"module 'svrmad_local' has no attribute {name!r}")
