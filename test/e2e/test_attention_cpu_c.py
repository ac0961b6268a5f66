"""Fused attention trains on cpu-c as the interpreter trains the materialised one.

The experiment of `test_attention_cuda_sim.py` (the prelude's causal attention with heads sliced from a
packed QKV projection, and one written with the scale on Q and no mask, in heads) on `cpu-c`, whose C
attention kernels (`backends/cpu_c/attention.py`) replace the scores' GEMMs and softmax: the losses of a
few steps agree with the interpreter's within f32 rounding (1e-5), and within 2e-2 in bf16, whatever the
thread count (bit for bit). Sequences of 7 tokens, so no row of a head is a multiple of a vector.
"""

from __future__ import annotations

import numpy as np
import pytest
from sexpgpu.backends.cpu_c.compiler import missing_compiler
from test_attention_cuda_sim import EXPERIMENT
from test_guards_cuda_sim import losses

pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="no C compiler with OpenMP on this machine")


@pytest.fixture
def experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(17)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((6, 7, 64)).astype(np.float32))

    def write(precision: str):
        source = tmp_path / f"attention-{precision}.sx"
        source.write_text(EXPERIMENT.replace("PRECISION", precision))
        return source
    return write


@pytest.mark.parametrize(("precision", "tolerance"), [("f32", 1e-5), ("bf16", 2e-2)])
def test_fused_attention_trains_as_the_interpreter(tmp_path, experiment, precision, tolerance):
    source = experiment(precision)
    want, _ = losses(source, tmp_path / "cpu", "cpu")
    got, report = losses(source, tmp_path / "c", "cpu-c")
    assert all(np.isfinite(want))
    assert got == pytest.approx(want, rel=tolerance)
    assert "attention" in report and "forward 2, backward 2" in report, report


def test_fused_attention_does_not_depend_on_the_thread_count(tmp_path, experiment, monkeypatch):
    source = experiment("f32")
    runs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        runs.append(losses(source, tmp_path / f"threads-{threads}", "cpu-c")[0])
    assert runs[0] == runs[1]
