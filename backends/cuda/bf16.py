"""bf16 as CUDA rounds it, for the scalar arguments both runtimes pack (the driver's and cuda-sim's)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def bf16_bits(value: float) -> int:
    """`value` as CUDA's __float2bfloat16 rounds it: to nearest even, every NaN to 0x7fff."""
    if math.isnan(value):
        return 0x7FFF
    return int(np.array(value, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
