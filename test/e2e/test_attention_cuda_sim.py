"""Fused attention trains on cuda-sim as the interpreter trains the materialised one.

issue 17, items 1 and 4. The prelude's attention (heads sliced from a packed
QKV projection, causal mask added as a tensor of -inf) and one written with
the scale on Q and no mask are recognised by match-patterns and launched as
the attention kernels (forward and backward); the interpreter computes them
as written. The losses of a few steps agree within f32 rounding (1e-5), and within 2e-2 in bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_guards_cuda_sim import losses

EXPERIMENT = """\
(defloader data :source (npy-file "data.npz") :fields ((x [7 64] f32)) :batch 2)
(defmodule net ()
  (let ((attn (sub attn (attention 64 2)))
        (wq (param wq [64 64] :init (normal 0.2)))
        (wk (param wk [64 64] :init (normal 0.2)))
        (wv (param wv [64 64] :init (normal 0.2))))
    (fn (x)
      (let* ((x (+ x (attn x)))
             (q (* (split-heads (matmul x wq) 2) (/ 1.0 (sqrt 32))))
             (k (split-heads (matmul x wk) 2))
             (v (split-heads (matmul x wv) 2)))
        (merge-heads (matmul (softmax (matmul q (transpose k -1 -2)) -1) v))))))
(defmodel model (net))
(defn objective (batch) (let ((d (- (model (get batch :x)) (get batch :x)))) (mean (* d d))))
(defoptimizer opt (sgd :lr 0.5))
(defrun :steps 3 :loader data :objective objective :optimizer opt :checkpoints none :precision PRECISION)
"""


@pytest.mark.parametrize(("precision", "tolerance"), [("f32", 1e-5), ("bf16", 2e-2)])
def test_fused_attention_trains_as_the_interpreter(tmp_path, precision, tolerance):
    rng = np.random.default_rng(17)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((6, 7, 64)).astype(np.float32))
    source = tmp_path / "attention.sx"
    source.write_text(EXPERIMENT.replace("PRECISION", precision))
    want, _ = losses(source, tmp_path / "cpu", "cpu")
    got, report = losses(source, tmp_path / "sim", "cuda-sim")
    assert all(np.isfinite(want))
    assert got == pytest.approx(want, rel=tolerance)
    assert "attention" in report and "forward 2, backward 2" in report, report
