"""Group-wide updates and clipping over flat buffers: bit-identical to the per-parameter graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sexpgpu.backends.training as training
from _plans import training_plan
from sexpgpu.passes.flat_updates import flat_update_graph

ROOT = Path(__file__).resolve().parents[2]


def trainer(flat: bool, example: str = "tiny-gpt.sx") -> training.Trainer:
    plan = training_plan(str(ROOT / "examples" / example), "smoke", [], flat)
    return training.Trainer(plan, Path("/nonexistent-record"), None)


def test_flat_group_updates_and_clip_are_bit_identical_to_per_parameter_graphs():
    flat, single = trainer(True), trainer(False)
    assert len(flat.flat_groups) == 1 and not single.flat_groups
    assert flat.clips and all(np.shares_memory(flat.params[p], flat.flat_params) for p in flat.params)
    for step in range(1, 5):
        assert flat.train_step(step)[0] == single.train_step(step)[0]
    for name, value in single.params.items():
        assert np.array_equal(flat.params[name], value), name
    for name, value in single.states.items():
        assert np.array_equal(flat.states[name], value), name


def test_microbatch_scaling_of_a_flat_group_and_a_lone_parameter_is_bit_identical():
    """gpt.sx smoke: 4 microbatches (the summed gradients scaled by 1/4 over the flat array), a flat
    group and a one-member group (the embedding, updated and scaled on its own)."""
    flat, single = trainer(True, "gpt.sx"), trainer(False, "gpt.sx")
    assert flat.plan.microbatches == 4 and len(flat.flat_groups) == 1 and "model.embed.table" not in flat.flat_bounds
    for step in range(1, 4):
        assert flat.train_step(step)[0] == single.train_step(step)[0]
    for name, value in single.params.items():
        assert np.array_equal(flat.params[name], value), name
    for name, value in single.states.items():
        assert np.array_equal(flat.states[name], value), name


def test_graphs_that_differ_beyond_the_shape_are_not_flattened(monkeypatch):
    exp = training.TrainingPlan.compile(str(ROOT / "examples" / "tiny-gpt.sx"), "smoke", [])
    updates = exp.graphs_of_kind("update")
    assert flat_update_graph(updates, sum(op.attributes["type"].numel for op in exp.param_ops)) is not None
    # A clip graph sums over each gradient: not elementwise.
    assert flat_update_graph(exp.graphs_of_kind("clip"), 10) is None
    # A different constant in one member.
    const = next(op for op in updates[1].body.ops if op.name == "graph.const" and op.result.type.rank > 0)
    monkeypatch.setitem(const.attributes, "value", 0.5)
    assert flat_update_graph(updates, 10) is None



def test_an_update_graph_scaling_the_summed_gradients_is_bit_identical_to_scaling_them_first():
    """With 3 microbatches the update graph multiplies the gradient by 1/3 itself (no scaling pass): the
    same f32 product as the gradient scaled before the update graph of a run of one microbatch."""
    from sexpgpu.backends.interpreter.compiler import compile_graph
    from sexpgpu.dialects.parser import parse_module
    from sexpgpu.passes.manager import CompilationUnit, run_pipeline

    def update(microbatches: int) -> object:
        text = (
            'exp.param {group = "default", init = {kind = "zeros"}, path = "w", type = tensor<5x7xf32>}\n'
            'exp.group {hyper = {lr = {kind = "warmup-cosine", peak = 0.01, floor = 0.1, steps = 10, warmup = 2},'
            ' weight_decay = 0.1}, members = ["w"], name = "default", optimizer = "adamw"}\n'
            f'exp.run {{loader = "train", microbatches = {microbatches}, precision = "f32", seed = 0, steps = 10}}\n')
        unit = run_pipeline(CompilationUnit(module=parse_module(text, "run.sxir")), "build-updates")
        return compile_graph(next(op for op in unit.module.body.ops if op.name == "graph.func"))

    folded, plain = update(3), update(1)
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal((5, 7)).astype(np.float32) for name in ("param", "grad", "m")}
    inputs["v"] = np.abs(rng.standard_normal((5, 7))).astype(np.float32)
    inputs["step"] = np.asarray(3.0, dtype=np.float32)
    scaled = {**inputs, "grad": inputs["grad"] * np.float32(1 / 3)}
    expected = plain(scaled).outputs
    for name, value in folded(inputs).outputs.items():
        assert np.array_equal(value, expected[name]), name
    assert not np.array_equal(folded(inputs).outputs["m"], plain(inputs).outputs["m"])
