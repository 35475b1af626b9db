"""The old home of SamplingParams, now in engine/config.py; this path stays importable."""

from .config import SamplingParams  # noqa: F401
