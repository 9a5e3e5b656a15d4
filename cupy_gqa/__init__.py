"""cupy_gqa: causal grouped-query attention for NVIDIA GPUs, compiled at runtime."""

__version__ = "0.1.0"
