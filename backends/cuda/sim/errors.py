"""What the simulated device raises.

Every one of these is a bug in a kernel or in the code that launches it,
never a user error in a `.sx` file: the tools report them as internal errors
(exit 3).
"""

from __future__ import annotations


class SimError(RuntimeError):
    """Base of cuda-sim's errors."""


class CompileError(SimError):
    """The host compiler rejected a CUDA source; `log` holds its full output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


class LaunchError(SimError):
    """A launch the device refuses before running anything: its shape, its arguments."""


class KernelFault(SimError):
    """A kernel did something CUDA leaves undefined, or crashed, while it ran."""


class ScheduleMismatch(KernelFault):
    """A kernel's results depend on the order its threads run in: they race."""
