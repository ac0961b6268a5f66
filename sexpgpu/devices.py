"""The devices a verb can target, and what this build can open."""

from __future__ import annotations

import os

from .diagnostics import SxError, UsageError

DEVICES = ("cpu", "cuda")


def default_device() -> str:
    """`$SEXPGPU_DEVICE`, else the CPU."""
    return os.environ.get("SEXPGPU_DEVICE") or "cpu"


def require_available(device: str, verb: str) -> None:
    """A usage error for an unknown device; a user error for CUDA, which this build has no executor for."""
    if device not in DEVICES:
        raise UsageError(f"--device must be cpu or cuda, not {device}")
    if device == "cuda":
        raise SxError(f"the CUDA executor is not available in this build, so {verb} --device cuda cannot run; "
                      "use --device cpu (or unset SEXPGPU_DEVICE)")
