"""The spec GPT's loss and every gradient against the same model written independently in PyTorch.

`examples/gpt.sx --variant smoke` is compiled through the training pipeline;
its `train` graph runs on the interpreter in f32 from parameters that are the
run's initial values plus noise (so layernorm weights and biases are not 1 and
0), and `gpt_reference.TorchGPT` gets copies of the same parameters by path.
Each gradient must agree within 1e-4 by max|ours - torch| / max|torch|.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gpt_reference import TorchGPT  # noqa: E402

import sexpgpu  # noqa: E402  (after the torch skip)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.sx"
RELATIVE_TOLERANCE = 1e-4


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max|a - b| / max|b|: robust where single elements of the reference are near zero."""
    scale = float(np.max(np.abs(theirs)))
    assert scale > 0, "a reference gradient is all zeros"
    return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs))) / scale


def test_loss_and_every_gradient_match_pytorch():
    torch.set_num_threads(1)
    exp = sexpgpu.compile(str(EXAMPLE), variant="smoke")
    heads = int(exp.selection["heads"][0])
    rng = np.random.default_rng(0)
    params = {path: (value + 0.05 * rng.standard_normal(value.shape)).astype(np.float32)
              for path, value in exp.init_params().items()}
    tokens = rng.integers(0, 256, (4, exp.selection["seq"][0] + 1)).astype(np.int32)
    ours = exp.run_graph("train", {**params, "tokens": tokens})

    model = TorchGPT(params, heads, {"hyper": {"lr": 0.0, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}})
    loss = model.loss(tokens)
    loss.backward()

    assert abs(float(ours["loss"]) - float(loss.detach())) <= RELATIVE_TOLERANCE * abs(float(loss.detach()))
    assert ours["grads"].keys() == model.params.keys() == params.keys()
    errors = {path: relative_error(ours["grads"][path], tensor.grad.numpy()) for path, tensor in model.params.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RELATIVE_TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"
