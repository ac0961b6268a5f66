"""cuda-sim: a simulated CUDA device that runs CUDA C kernels on the host CPU.

The same source NVRTC compiles for a GPU is compiled by the host C++
compiler against `cuda_sim.h`; threads are fibers, blocks run one at a time,
and the device reports what a GPU leaves undefined (barrier divergence,
shuffles from absent lanes, writes past a buffer). docs/cuda.md, section
cuda-sim, says how it works and what it cannot catch.
"""

from .compiler import HEADER_PATH, KernelParam, SimKernel, SimModule, compile_module, default_cache_dir
from .device import ROUND_ROBIN, SCHEDULES, WARP_AFTER_WARP, SimDevice, bf16_bits
from .errors import CompileError, KernelFault, LaunchError, ScheduleMismatch, SimError
from .memory import DeviceBuffer, DeviceMemory

__all__ = [
    "HEADER_PATH", "KernelParam", "SimKernel", "SimModule", "compile_module", "default_cache_dir",
    "ROUND_ROBIN", "SCHEDULES", "WARP_AFTER_WARP", "SimDevice", "bf16_bits",
    "CompileError", "KernelFault", "LaunchError", "ScheduleMismatch", "SimError",
    "DeviceBuffer", "DeviceMemory",
]
