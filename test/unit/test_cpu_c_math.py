"""cpu-c's inline `exp` and `erf` (`backends/cpu_c/kernels.py`, `sx_expf` and `sx_erff`, whose polynomials
step by fused multiply-adds where the host has them): within the ulps docs/backends.md states of the
float64 functions, over the range a model feeds them; their limits and NaNs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sexpgpu.backends.cpu_c.compiler import missing_compiler
from sexpgpu.backends.devices import open_device
from sexpgpu.dialects.parser import parse_module

pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="no C compiler with OpenMP on this machine")

SIZE = 200_003  # not a multiple of any vector width: the loops' tails run too


def unary(op: str) -> str:
    return f"""
graph.func @math {{kind = "eval"}} {{
  %x = graph.input {{name = "x", role = "batch"}} : () -> tensor<{SIZE}xf32>
  %y = graph.{op} %x {{path = "m"}} : (tensor<{SIZE}xf32>) -> tensor<{SIZE}xf32>
  graph.return %y {{names = ["y"]}} : (tensor<{SIZE}xf32>) -> ()
}}
"""


def run_cpu_c(op: str, x: np.ndarray) -> np.ndarray:
    module = parse_module(unary(op), "math.sxir")
    func = next(o for o in module.body.ops if o.name == "graph.func")
    executor = open_device("cpu-c", "test")
    result = executor.compile(func)({"x": executor.upload(x)})
    return np.array(executor.download(result.outputs["y"]))


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)


@pytest.mark.parametrize(("op", "low", "high", "bound", "exact"), [
    ("exp", -86.9, 88.0, 1.5, np.exp),
    ("erf", -5.0, 5.0, 7.0, np.vectorize(math.erf)),
])
def test_exp_and_erf_are_within_their_ulps(op: str, low: float, high: float, bound: float, exact) -> None:
    x = np.random.default_rng(0).uniform(low, high, SIZE).astype(np.float32)
    x[:5] = [0.0, -0.0, 1e-20, -1e-20, 0.5]
    got = run_cpu_c(op, x)
    want = exact(x.astype(np.float64))
    assert ulps(got, want).max() <= bound


def test_limits_and_nans_are_numpys() -> None:
    x = np.zeros(SIZE, np.float32)
    x[:7] = [np.nan, np.inf, -np.inf, 100.0, -100.0, 88.8, -87.0]
    got = run_cpu_c("exp", x)
    assert np.isnan(got[0])
    assert np.array_equal(got[1:7], np.array([np.inf, 0.0, np.inf, 0.0, np.inf, 0.0], np.float32))
    got = run_cpu_c("erf", x)
    assert np.isnan(got[0])
    assert np.array_equal(got[1:5], np.array([1.0, -1.0, 1.0, -1.0], np.float32))
