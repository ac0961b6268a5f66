"""The two ways the CUDA toolchain fails: not installed (the user's to fix) or a rejected kernel (ours).

`KernelCompileError` names its compiler, so the other compiler of generated CUDA C (the host
compiler of `cuda-sim`) can raise it too and the code generator attaches a model path to either
the same way.
"""

from __future__ import annotations

from ...diagnostics import SxError

#: What to run to get the `cuda` extra, for an installed package and for a checkout.
INSTALL_COMMAND = "pip install 'sexpgpu[cuda]' (in a checkout: pip install -e '.[cuda]')"


class CudaToolchainMissing(SxError):
    """A part of the `cuda` extra is missing: a user error (exit 1) in one line naming the install command."""

    def __init__(self, missing: str, needed_for: str) -> None:
        super().__init__(f"{missing}, which {needed_for} needs; install the CUDA toolchain with {INSTALL_COMMAND}")


class KernelCompileError(Exception):
    """A generated kernel its compiler rejected: a bug in sexpgpu's code generator, so an internal error (exit 3).

    It carries the compiler's log and the kernel's name; the code generator, which knows the region a
    kernel was made from, adds its model path with `at` before letting the error go.
    """

    def __init__(self, kernel: str, target: str, log: str, model_path: str | None = None, compiler: str = "NVRTC") -> None:
        super().__init__(kernel, target, log, model_path, compiler)
        self.kernel = kernel
        self.target = target
        self.log = log
        self.model_path = model_path
        self.compiler = compiler

    def at(self, model_path: str) -> KernelCompileError:
        """This error, naming the model path of the region the kernel was generated from."""
        self.model_path = model_path
        return self

    def __str__(self) -> str:
        where = f" (model path {self.model_path})" if self.model_path else ""
        return f"{self.compiler} rejected the generated kernel {self.kernel}{where} for {self.target}:\n{self.log.rstrip()}"
