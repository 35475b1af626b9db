"""svrmad-local: a local inference engine for multi-agent debate (SVR-MAD and its baselines)."""

__version__ = "0.1.0"
