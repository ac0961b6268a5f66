"""A guard is never dropped: clamped norms and a floored loss train on cuda-sim as the interpreter trains them.

issue 17, item 0. A layernorm whose variance is floored (`maximum var 1e-5`),
an rmsnorm floored at 0.01 and a loss whose log-probabilities are floored at
-30 are the plain families on the random rows match-patterns samples, but
not on a row of zeros or logits of huge scale. Recognition must refuse them
(a `fell back` line in the lowering report), so `fuse` computes them as
written. The data holds rows of zeros (padding), where a kernel that dropped
the variance's floor gives NaN and the interpreter trains; an eps added (the
family's own form, taken) trains alike.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.events import read_events
from sexpgpu.backends.training import train

from sexpgpu.report.lowering_text import lowering_text

EXPERIMENT = """\
(defloader data :source (npy-file "data.npz") :fields ((x [16] f32) (t [] i32)) :batch 8)
(defmodule net ()
  (let ((lin (sub lin (linear 16 16)))
        (w (param w [16] :init ones))
        (b (param b [16] :init zeros))
        (head (sub head (linear 16 16))))
    (fn (x)
      (let* ((x (lin x))
             (c (- x (mean x -1 :keep true)))
             (x (+ (* (* c (rsqrt (maximum (mean (* c c) -1 :keep true) 1e-5))) w) b))
             (x (* x (rsqrt (maximum (mean (* x x) -1 :keep true) 0.01))))
             (c (- x (mean x -1 :keep true)))
             (x (* c (rsqrt (+ (mean (* c c) -1 :keep true) 0.01)))))
        (head x)))))
(defmodel model (net))
(defn objective (batch)
  (let ((logp (maximum (log-softmax (model (get batch :x)) -1) -30.0)))
    (neg (mean (take-along logp (expand-dims (get batch :t) -1) -1)))))
(defoptimizer opt (sgd :lr 0.5))
(defrun :steps 3 :loader data :objective objective :optimizer opt :checkpoints none)
"""


def losses(source: Path, out: Path, device: str) -> tuple[list[float], str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        result = train(str(source), out=out, device=device, stream=io.StringIO(), interactive=False,
                       lowering_text=lowering_text)
    assert result.status == "done", result.message
    return [e["loss"] for e in read_events(out / "events.jsonl") if e["type"] == "step"], stderr.getvalue()


def test_clamped_norms_and_a_floored_loss_fall_back_and_train_as_the_interpreter(tmp_path):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((24, 16)) * 3.0).astype(np.float32)
    x[::3] = 0.0  # padding rows
    np.savez(tmp_path / "data.npz", x=x, t=rng.integers(0, 16, 24).astype(np.int32))
    source = tmp_path / "guards.sx"
    source.write_text(EXPERIMENT)
    want, _ = losses(source, tmp_path / "cpu", "cpu")
    got, report = losses(source, tmp_path / "sim", "cuda-sim")
    assert all(np.isfinite(want))
    assert got == pytest.approx(want, rel=1e-5)
    assert "fell back" in report and "maximum with 1e-05" in report, report
