"""The floating-point dtypes a model may be stored and run in, under the names configs use.

One table for config names, torch dtypes and safetensors tags, so that every reader and writer agrees.
"""

from __future__ import annotations

import torch

from mars_megatron.config import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
assert tuple(TORCH_DTYPES) == DTYPE_NAMES

# safetensors header tags (the format's own names), for every dtype a checkpoint tensor may have.
SAFETENSORS_TAGS: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; an unknown name is a ValueError listing the valid ones."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; valid: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]
