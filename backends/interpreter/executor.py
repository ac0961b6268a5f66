"""The numpy interpreter as the `cpu` executor: its arrays are numpy arrays in host memory."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...dialects.core import Operation
from ..executor import Executor
from .compiler import CompiledGraph, compile_graph
from .dtypes import DtypePolicy


class HostArrays:
    """Arrays of an executor whose memory is the host's: numpy arrays, so `download` and checkpoints need
    nothing (the interpreter, and the compiled CPU target)."""

    def upload(self, host: np.ndarray) -> np.ndarray:
        return np.array(host, order="C")

    def download(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def copy(self, source: np.ndarray, target: np.ndarray) -> None:
        # No broadcasting or casting: a device copy moves bytes, so the driver must not rely on either.
        if source.shape != target.shape or source.dtype != target.dtype:
            raise ValueError(f"copy of a {source.dtype}{list(source.shape)} array into a "
                             f"{target.dtype}{list(target.shape)} one")
        np.copyto(target, source)

    def view(self, flat: np.ndarray, offset: int, shape: Sequence[int]) -> np.ndarray:
        return flat[offset:offset + math.prod(shape)].reshape(tuple(shape))

    def write(self, target: np.ndarray, host: np.ndarray) -> None:
        # Converted to the target's dtype: the ranks' host staging writes gathered bf16 copies from float32.
        np.copyto(target, np.asarray(host), casting="unsafe")


class InterpreterExecutor(HostArrays, Executor):
    """Compiles graphs with `compile_graph`; uploads and downloads are host copies and views."""

    device = "cpu"

    def __init__(self, float_mode: str = "native") -> None:
        self.float_mode = float_mode
        self._policy = DtypePolicy(float_mode)

    def compile(self, func: Operation) -> CompiledGraph:
        return compile_graph(func, self.float_mode)

    def zeros(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        return np.zeros(tuple(shape), self._policy.storage(dtype))

