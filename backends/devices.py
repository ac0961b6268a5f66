"""The devices a verb can target, and opening their executors (`executor.py`).

Below the training driver, beside the executor registry: the driver and the verbs open a device the same
way, and nothing in the backends reaches up to the top layer for it."""

from __future__ import annotations

import os
from typing import Any

from ..diagnostics import SxError, UsageError
from .executor import Executor, open_executor, unavailable_reason

#: What `--device` accepts (`cpu-c`: the compiled CPU target; `cuda-sim`: the simulated CUDA device, for
#: tests); whether this build and machine can open one is the executor registry's answer.
DEVICES = ("cpu", "cpu-c", "cuda", "cuda-sim")


def default_device() -> str:
    """`$SEXPGPU_DEVICE`, else the CPU."""
    return os.environ.get("SEXPGPU_DEVICE") or "cpu"


def _register_builtin_executors() -> None:
    # Importing a backend package registers its executor; here, not at the top, so that parsing
    # a command line loads no backend.
    from . import cpu_c, cuda, interpreter  # noqa: F401


def require_available(device: str, verb: str) -> None:
    """A usage error for an unknown device; a user error, with the registry's reason, for one that
    this build has no executor for or that cannot open on this machine."""
    if device not in DEVICES:
        raise UsageError(f"--device must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]}, not {device}")
    _register_builtin_executors()
    reason = unavailable_reason(device)
    if reason is not None:
        raise SxError(f"the {device.upper()} executor {reason}, so {verb} --device {device} cannot run; "
                      "use --device cpu (or unset SEXPGPU_DEVICE)")


def open_device(device: str, verb: str, **options: Any) -> Executor:
    """The executor of `device` for `verb`, after `require_available`."""
    require_available(device, verb)
    return open_executor(device, **options)
