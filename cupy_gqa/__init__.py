"""cupy_gqa: causal grouped-query attention for NVIDIA GPUs, compiled at runtime by NVRTC.

    import cupy_gqa
    out = cupy_gqa.attention(q, k, v)   # CuPy arrays, torch tensors or NumPy arrays
"""

__version__ = "0.1.0"

from ._mods import MaskMod, ScoreMod
from .api import (
    KERNELS, attention, attention_backward, attention_varlen, decode_workspace, decode_workspace_size, warmup, workspace,
    workspace_size,
)

__all__ = [
    "attention", "attention_varlen", "attention_backward", "ScoreMod", "MaskMod", "workspace", "workspace_size", "decode_workspace", "decode_workspace_size", "warmup",
    "KERNELS", "__version__",
]  # fmt: skip
