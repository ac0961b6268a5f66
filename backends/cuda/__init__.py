"""The CUDA backend: registers the CUDA executor as `cuda` and `cuda-sim` (backends/executor.py).

Importing this package loads nothing of CUDA: the probes ask `selection.runtime_unavailable` (which
opens no context) and the factory imports the executor when a device is opened.
"""

from __future__ import annotations

from typing import Any

from ..executor import Executor, register_executor
from .selection import DEVICES, runtime_unavailable


def _register(device: str) -> None:
    def factory(**options: Any) -> Executor:
        from .executor import open_cuda_executor

        return open_cuda_executor(device, **options)

    register_executor(device, factory, probe=lambda: runtime_unavailable(device))


for _device in DEVICES:
    _register(_device)
