"""What a CUDA device compiles its kernels with: the interface both compilers implement.

A CUDA device is a renderer, an allocator, a compiler and a runtime, as
tinygrad's `Compiled` device is. `cuda` and `cuda-sim` share the renderer
(`render/`), the allocator logic (`memory.py`) and the executable
(`executable.py`); they differ in their compiler (`lowering.NvrtcCompiler`:
NVRTC to CUBIN; `driver_sim.HostCompiler`: the host C++ compiler to a shared
object) and their runtime (`driver_cuda`/`driver_pycuda` vs `driver_sim`).
Each runtime carries its compiler (`DeviceRuntime.compiler`), so the code that
picks a runtime (`selection.open_runtime`) is the only code that tells them
apart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...dialects.core import Operation


class KernelCompiler(ABC):
    """What turns CUDA C into the binary one runtime loads: with the runtime, all that tells the CUDA
    devices apart (tinygrad's `Compiler`; the renderer, allocator logic and executable are shared)."""

    @abstractmethod
    def compile(self, source: str, name: str) -> Any:
        """`source` compiled (disk-cached by content); `name` names the program in logs and errors."""

    def compiled_facts(self, module: Operation, binary: Any) -> dict[str, Any] | None:
        """The lowering report's `compiled` figures of `module`'s kernels in `binary` (registers, spills,
        limits); None where the compiler tells none."""
        return None
