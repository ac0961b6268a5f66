"""The spec GPT's train-graph gradients against central finite differences, in float64.

`examples/gpt.sx --variant smoke` (narrowed by knob sets so the many loss
evaluations stay quick; the vocabulary stays the example's 256) goes through
`evaluate,autodiff`; the train graph runs in the interpreter's f64 mode, and a
few elements each of the embedding, a qkv weight, a layernorm weight and the
output projection are moved by ±h.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.sx"
SETS = ["width=32", "heads=2", "seq=8"]
STEP = 1e-5
CHECKED = {
    "model.embed.table": 3,
    "model.blocks.0.attn.qkv.weight": 4,
    "model.blocks.1.attn.qkv.weight": 2,
    "model.blocks.1.norm1.weight": 3,
    "model.norm.weight": 2,
    "model.blocks.0.attn.proj.weight": 3,
    "model.proj.weight": 3,
}


@pytest.fixture(scope="module")
def train_graph():
    unit = run_pipeline(CompilationUnit(path=str(EXAMPLE), variant="smoke", sets=SETS), "evaluate,autodiff")
    func = next(op for op in unit.module.body.ops if op.name == "graph.func" and op.attributes.get("kind") == "train")
    return compile_graph(func, float_mode="f64")


def test_gradients_match_central_differences(train_graph):
    rng = np.random.default_rng(0)
    feed = {}
    for spec in train_graph.inputs:
        if spec.role == "param":
            # Layernorm weights near 1 (as initialized), everything else of a trained model's scale.
            base = 1.0 if spec.name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
            feed[spec.name] = base + 0.3 * rng.standard_normal(spec.type.shape)
        else:
            feed[spec.name] = rng.integers(0, 256, spec.type.shape).astype(spec.storage)
    assert set(CHECKED) <= set(feed)
    result = train_graph(feed)
    tokens = feed["tokens"]
    for name, count in CHECKED.items():
        grad = result.outputs[f"grad/{name}"]
        assert grad.shape == feed[name].shape
        if name == "model.embed.table":
            # Only the rows of tokens the model reads have a gradient: pick those.
            rows = rng.choice(np.unique(tokens[:, :-1]), count)
            elements = [(int(r), int(rng.integers(0, grad.shape[1]))) for r in rows]
        else:
            elements = [tuple(int(rng.integers(0, d)) for d in grad.shape) for _ in range(count)]
        for i in elements:
            losses = []
            for sign in (1, -1):
                moved = feed[name].copy()
                moved[i] += sign * STEP
                losses.append(float(train_graph({**feed, name: moved}).outputs["loss"]))
            numeric = (losses[0] - losses[1]) / (2 * STEP)
            assert grad[i] == pytest.approx(numeric, rel=1e-6, abs=1e-9), f"{name}{list(i)}"
