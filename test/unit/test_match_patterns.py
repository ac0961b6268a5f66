"""match-patterns on examples/gpt.sx: the facts the lowering report renders, and the IR it leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = "evaluate,autodiff,canonicalize,cse,dce"


@pytest.fixture(scope="module")
def lowered() -> CompilationUnit:
    unit = CompilationUnit(path=str(ROOT / "examples" / "gpt.sx"), variant="smoke")
    PassManager(parse_pipeline(GRAPHS + ",match-patterns,verify")).run(unit)
    return unit


def test_facts_per_graph_and_family(lowered: CompilationUnit) -> None:
    train = lowered.facts.lowering.patterns["train"]
    assert train["cross_entropy_forward"] == {
        "group": "cross-entropy tail", "direction": "forward", "kernels": ["cross_entropy_forward_f32_256_mean",
                                                                       "cross_entropy_forward_f32_256_mean_sum_reduce"],
        "fired": 1, "paths": ["model.proj"], "as": ["gather of log-probabilities, negated per row"], "fell_back": []}
    assert train["cross_entropy_backward"]["paths"] == ["model.proj"]
    # Without `diagnose`, the model's observation of the probabilities stays in @train: attention falls back
    # there, and the softmax is a row program (the training pipeline moves observations to @train_diagnosed).
    assert train["softmax"]["paths"] == ["model.blocks.0.attn", "model.blocks.1.attn"]
    assert train["softmax_backward"]["paths"] == ["model.blocks.1.attn", "model.blocks.0.attn"]
    assert train["attention_forward"]["group"] == "attention"
    assert train["attention_forward"]["fell_back"][0] == {
        "path": "model.blocks.0.attn", "reason": "an observation (model.blocks.0.attn.probs) reads the probabilities",
        "loc": "examples/lib/model.sx:13"}
    assert train["layernorm"] == {
        "group": "row programs", "direction": "forward", "kernels": ["layernorm_f32_128_stats"], "fired": 5,
        "paths": ["model.blocks.0.norm1", "model.blocks.0.norm2", "model.blocks.1.norm1", "model.blocks.1.norm2",
                  "model.norm"],
        "as": [], "fell_back": []}
    assert train["layernorm_backward"]["fired"] == 5
    evaluation = lowered.facts.lowering.patterns["eval"]
    assert set(evaluation) == {"layernorm", "attention_forward", "cross_entropy_forward"}
    assert evaluation["attention_forward"]["fired"] == 2
    assert evaluation["layernorm"]["kernels"] == ["layernorm_f32_128"]


def test_no_row_reduction_is_left_in_the_model_graphs(lowered: CompilationUnit) -> None:
    """What is left for `fuse` are the loss's and the gradients' sums over rows and batches and the GELU's
    elementwise math, not a piece of a row program."""
    for func in (op for op in lowered.module.body.ops if op.name == "graph.func"):
        for op in func.regions[0].blocks[0].ops:
            if op.name in ("graph.max", "graph.log", "graph.rsqrt", "graph.take_along", "graph.scatter_add_along"):
                raise AssertionError(f"{op.name} left in @{func.attributes['sym_name']}")


def test_the_output_prints_parses_and_is_a_fixpoint(lowered: CompilationUnit) -> None:
    text = print_module(lowered.module)
    module = parse_module(text, "lowered.sxir")
    assert print_module(module) == text
    again = CompilationUnit(module=module)
    PassManager(parse_pipeline("match-patterns")).run(again)
    assert print_module(again.module) == text
    assert all(not families for families in again.facts.lowering.patterns.values())


def test_fell_back_facts_carry_path_reason_and_location(tmp_path: Path) -> None:
    path = tmp_path / "observed.sx"
    path.write_text("""(defloader data :source (npy-file "p.npy") :fields ((x [5 16] f32) (t [5] i32)) :batch 2)
(defmodel model (linear 16 16))
(defn objective (batch)
  (let ((logp (log-softmax (model (get batch :x)) -1)))
    (observe logp logp)
    (neg (mean (take-along logp (expand-dims (get batch :t) -1) -1)))))
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 1 :loader data :objective objective :optimizer opt)
""")
    unit = CompilationUnit(path=str(path))
    PassManager(parse_pipeline(GRAPHS + ",match-patterns")).run(unit)
    facts = unit.facts.lowering.patterns["train"]
    assert facts["cross_entropy_forward"]["fired"] == 0
    assert facts["cross_entropy_forward"]["fell_back"] == [
        {"path": "model", "reason": "an observation (logp) reads a value inside the region", "loc": f"{path}:4"}]
    (backward,) = facts["cross_entropy_backward"]["fell_back"]
    assert backward["reason"] == "its forward fell back, and no value holds the lse its kernel reads"


@pytest.mark.parametrize(("pipeline", "fuses"), [
    ("gemm-layouts{transposes=false},match-patterns,gemm-layouts,fuse,plan-buffers,emit-cuda", True),
    ("match-patterns{attention=false},fuse", False),
    ("canonicalize,fuse", False),
])  # fmt: skip
def test_a_lowering_fuses_attention_where_match_patterns_asks_its_target_for_it(pipeline: str, fuses: bool) -> None:
    from sexpgpu.passes.match_patterns import fuses_attention

    assert fuses_attention(pipeline) is fuses


def test_explain_leaves_the_attention_tensors_unnamed_where_the_device_fuses_attention() -> None:
    from sexpgpu.backends.cpu_c.executor import CpuCExecutor
    from sexpgpu.backends.cuda.executor import CudaExecutor
    from sexpgpu.backends.interpreter.executor import InterpreterExecutor
    from sexpgpu.tools.explain_cmd import attention_unheld_wanted

    assert not attention_unheld_wanted(CudaExecutor.lowering_pipeline)  # cuda and cuda-sim
    assert not attention_unheld_wanted(CpuCExecutor.lowering_pipeline)  # its C has attention kernels
    assert attention_unheld_wanted(InterpreterExecutor.lowering_pipeline)
