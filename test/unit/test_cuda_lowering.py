"""The CUDA lowering proven without a GPU.

- Every kernel `fuse` and `emit-cuda` make for the examples and for GPT-2
  small, lowered for sm_80 and for sm_90 (column reductions split for
  each one's SMs), compiles with NVRTC for it without a spill (one
  translation unit per module and architecture; the disk cache makes a
  second run cost milliseconds).
- Every kernel of small lowered graphs (the examples at awkward sizes, f32
  and bf16, and the graphs of the fuse lit tests) runs on cuda-sim, under
  both schedules, against the interpreter's values of the same ops: f32
  within 1e-5, bf16 within 2e-2, relative to the kernel's data
  (test/unit/cuda_lowering_harness.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from cuda_lowering_harness import (
    SimRunner,
    copies,
    graph,
    hint_values,
    lower,
    random_inputs,
    reference_values,
)
from sexpgpu.backends.cuda.nvrtc import compile_cubin
from sexpgpu.dialects.parser import parse_module
from sexpgpu.passes.flat_updates import flat_update_graph, param_type
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.pipelines import TRAINING_PIPELINE, cuda_lowering

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LIT = ROOT / "test" / "lit" / "passes"


def training_module(example: str, variant: str | None = None, sets: tuple[str, ...] = (), bf16: bool = False):
    pipeline = TRAINING_PIPELINE.replace("insert-casts", "insert-casts{policy=bf16}") if bf16 else TRAINING_PIPELINE
    path = EXAMPLES / example
    unit = CompilationUnit(path=str(path), text=path.read_text(), variant=variant, sets=list(sets))
    return run_pipeline(unit, pipeline).module


# -- NVRTC: every kernel, both architectures, no spill ----------------------------------------------

COMPILED = {
    "gpt-smoke": ("gpt.sx", "smoke"),
    "tiny-gpt": ("tiny-gpt.sx", None),
    "mlp-classifier": ("mlp-classifier.sx", None),
    "gpt2-small": ("gpt2-small.sx", None),
}


ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def lowered_sources() -> dict[tuple[str, str], tuple[str, list[str]]]:
    """Each example's translation unit (the whole CUDA lowering: pattern kernels, fused groups, GEMM
    epilogues, updates) lowered for each architecture (column reductions split for its SMs), and the
    functions its kernels name, lowered once."""
    sources = {}
    for key, (example, variant) in COMPILED.items():
        for arch in ARCHS:
            module = lower(training_module(example, variant), cuda_lowering(arch)).module
            source = next(op for op in module.body.ops if op.name == "kern.source").attributes["text"]
            functions = [op.attributes["function"] for op in module.body.ops if op.name == "kern.kernel"]
            sources[key, arch] = (source, functions)
    return sources


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("example", list(COMPILED))
def test_every_kernel_compiles_with_nvrtc_without_a_spill(lowered_sources, example, arch):
    source, functions = lowered_sources[example, arch]
    cubin = compile_cubin(source, arch, name=example)
    assert set(functions) <= set(cubin.kernels), set(functions) - set(cubin.kernels)
    assert cubin.spilling() == [], [f"{k.name}: {k.spill_stores} B stored, {k.spill_loads} B loaded"
                                    for k in cubin.spilling()]
    if example == "gpt2-small":
        assert "atomicAdd(in" in source, "GPT-2's bias gradients are split column reductions"


def test_layers_share_their_kernels():
    """Identical layers launch the same kernels: six layers need hardly more kernels than two (the
    one multi-tensor update is over more parameters; an op repeated once per layer that CSE cannot
    merge may group differently)."""
    def kernels(layers: int) -> int:
        module = lower(training_module("gpt.sx", "smoke", (f"layers={layers}",)), "fuse").module
        return sum(op.name == "kern.kernel" for op in module.body.ops)

    assert kernels(6) <= kernels(2) + 3


# -- cuda-sim: every kernel against the interpreter ---------------------------------------------------

SIMULATED = {
    "gpt-f32": ("gpt.sx", "smoke", ("layers=1", "width=36", "heads=3", "seq=13"), False, 7),
    "gpt-bf16": ("gpt.sx", "smoke", ("layers=1", "width=36", "heads=3", "seq=13"), True, 7),
    "tiny-gpt-f32": ("tiny-gpt.sx", "smoke", ("width=36", "heads=3", "seq=13", "batch=3"), False, 7),
    "tiny-gpt-bf16": ("tiny-gpt.sx", "smoke", ("width=36", "heads=3", "seq=13", "batch=3"), True, 7),
    "mlp-f32": ("mlp-classifier.sx", "smoke", ("hidden=19", "batch=7"), False, 3),
    "mlp-bf16": ("mlp-classifier.sx", "smoke", ("hidden=19", "batch=7"), True, 3),
}


def run_on_sim(reference_module, lowered_module, index_bound: int) -> SimRunner:
    """Every graph of the lowered module, kernel by kernel; a flat update graph is compared with the
    interpreter's run of the same flat graph built from the reference's per-parameter graphs."""
    runner = SimRunner(lowered_module)
    rng = np.random.default_rng(0)
    for func in [op for op in lowered_module.body.ops if op.name == "graph.func"]:
        name = func.attributes["sym_name"]
        if "members" in func.attributes:
            group = func.attributes["group"]
            members = [graph(reference_module, f"update/{group}/{m['path']}") for m in func.attributes["members"]]
            # Over the group's span: its members laid out as the flat arrays are, each aligned.
            flat = flat_update_graph(members, param_type(func).numel)
            reference_module.body.append(flat)
            hint_values(reference_module)
        reference = graph(reference_module, name)
        inputs = random_inputs(reference, rng, index_bound)
        runner.run(func, inputs, reference_values(reference, inputs))
    return runner


@pytest.mark.parametrize("config", list(SIMULATED))
def test_every_kernel_runs_on_cuda_sim_like_the_interpreter(config):
    example, variant, sets, bf16, index_bound = SIMULATED[config]
    reference, lowered = copies(training_module(example, variant, sets, bf16))
    lower(lowered)
    runner = run_on_sim(reference, lowered, index_bound)
    kernels = {op.attributes["sym_name"] for op in lowered.body.ops if op.name == "kern.kernel"}
    assert kernels == set(runner.launched), kernels - set(runner.launched)
    assert runner.errors


def _lit_chunks() -> list[tuple[str, int]]:
    chunks = []
    for path in sorted(LIT.glob("fuse-*.sxir")):
        if "expected-error" in path.read_text():
            continue
        for k, text in enumerate(path.read_text().split("// -----")):
            if 'kind = "row"' not in text:  # a hand-written pattern kernel has no code to run
                chunks.append((path.name, k))
    return chunks


@pytest.mark.parametrize(("name", "chunk"), _lit_chunks())
def test_lit_graphs_run_on_cuda_sim_like_the_interpreter(name, chunk):
    text = (LIT / name).read_text().split("// -----")[chunk]
    text = re.sub(r"^// .*$", "", text, flags=re.M)
    reference, lowered = copies(parse_module(text, name))
    lower(lowered)
    runner = run_on_sim(reference, lowered, 3)
    kernels = {op.attributes["sym_name"] for op in lowered.body.ops if op.name == "kern.kernel"}
    assert kernels == set(runner.launched), kernels - set(runner.launched)


def test_a_reader_kernel_with_no_plan_keeps_reading_the_stored_value(monkeypatch):
    """When the kernel that would recompute a value has no plan with the copies, the value stays
    stored (the copies are gone), the others are still recomputed, and every kernel computes what the
    interpreter does."""
    from sexpgpu.passes import fuse_recompute

    planned = []

    def first_refused(*args, **kwargs):
        planned.append(args[0])
        return None if len(planned) == 1 else fuse_recompute.plan_group.__wrapped__(*args, **kwargs)

    first_refused.__wrapped__ = fuse_recompute.plan_group
    monkeypatch.setattr(fuse_recompute, "plan_group", first_refused)
    text = re.sub(r"^// .*$", "", (LIT / "fuse-recompute.sxir").read_text().split("// -----")[0], flags=re.M)
    reference, lowered = copies(parse_module(text, "fuse-recompute.sxir"))
    lower(lowered)
    forward = next(op for op in lowered.body.ops if op.name == "kern.kernel" and op.attributes["inputs"] == [
        op.attributes["outputs"][0]] and len(op.attributes["outputs"]) == 2)
    # 1 + erf(h/√2) stored beside the activation; exp(-(h/√2)²) no longer computed there; h/2 still is (y's).
    assert forward.attributes["nodes"] == 5
    backward = next(op for op in lowered.body.ops if op.name == "kern.kernel" and len(op.attributes["inputs"]) == 3)
    assert any(inner.name == "graph.exp" for inner in backward.regions[0].blocks[0].ops)
    runner = run_on_sim(reference, lowered, 3)
    assert runner.errors


# -- plan-buffers: no two live buffers overlap -------------------------------------------------------


@pytest.mark.parametrize(("example", "variant", "bf16"), [("gpt.sx", "smoke", False), ("tiny-gpt.sx", "smoke", True)])
def test_live_buffers_never_overlap_but_in_place(example, variant, bf16):
    """Every pair of values whose storage is live at once lies in disjoint arena ranges, except an
    elementwise kernel's output over the operand it reads through the identity map for the last time."""
    from sexpgpu.dialects.liveness import StorageLiveness
    from sexpgpu.passes.plan_buffers import ALIGNMENT, in_place_reuse

    module = lower(training_module(example, variant, (), bf16), "fuse,plan-buffers").module
    checked = in_place = 0
    for func in (op for op in module.body.ops if op.name == "graph.func"):
        liveness = StorageLiveness(func.body)
        placed = []
        allowed = set()
        for op in func.body.ops:
            if "offsets" not in op.attributes:
                continue
            for result, taken in in_place_reuse(op, liveness).items():
                allowed.add((taken, result))
                in_place += 1
            for result, offset in zip(op.results, op.attributes["offsets"]):
                if offset is None:
                    assert liveness.root[result] in liveness.escaping
                    continue
                assert offset % ALIGNMENT == 0
                size = -(-result.type.nbytes // ALIGNMENT) * ALIGNMENT
                assert offset + size <= func.attributes["arena_bytes"]
                placed.append((result, liveness.defined[result], liveness.storage_end[result], offset, size))
        for i, (a, a_start, a_end, a_off, a_size) in enumerate(placed):
            for b, b_start, b_end, b_off, b_size in placed[i + 1:]:
                live_together = a_start <= b_end and b_start <= a_end
                overlap = a_off < b_off + b_size and b_off < a_off + a_size
                if live_together and overlap:
                    assert (a, b) in allowed and a_end == b_start, (func.attributes["sym_name"], a.name_hint, b.name_hint)
                checked += 1
    assert checked and in_place
