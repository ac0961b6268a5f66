"""The prelude every generated CUDA translation unit starts with, and the assembly of a unit.

`PRELUDE` (the text of `prelude.cuh`) includes `cuda_bf16.h` unless compiled
for cuda-sim, defines the constants NVRTC lacks (`SX_INF`, `SX_NAN`,
`SX_FLT_MAX`) and `CEIL_DIV`, and the device helpers the kernels use: bf16
and f32 loads and stores with f32 math (`sx_ld`, `sx_st`), packed loads and
stores of up to 16 bytes (`sx_ld_vec`, `sx_st_vec`), warp reductions by
`__shfl_xor_sync` (`sx_warp_sum`, `sx_warp_max`, `sx_warp_softmax`) and
block reductions through shared memory (`sx_block_sum`, `sx_block_max`,
`sx_block_softmax`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .kernel_source import KernelSource

PRELUDE_PATH = Path(__file__).with_name("prelude.cuh")
PRELUDE = PRELUDE_PATH.read_text()


def translation_unit(kernels: Iterable[KernelSource]) -> str:
    """The prelude and each distinct kernel once, in first-seen order: one self-contained CUDA source.

    Kernels are told apart by name; two different kernels under one name is a ValueError.
    """
    chosen: dict[str, KernelSource] = {}
    for kernel in kernels:
        seen = chosen.setdefault(kernel.name, kernel)
        if seen.code != kernel.code:
            raise ValueError(f"two different kernels are both named {kernel.name}")
    return "\n".join([PRELUDE, *(k.code for k in chosen.values())])
