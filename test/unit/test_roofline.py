"""The step estimate's model (passes/roofline.py): each launch's bytes and FLOPs against a hand count from
the model's shapes, the time of a launch and a step on a GPU of the table, the stacking a GPU chooses, and
`explain --gpu` with a GPU the table lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sexpgpu.dialects.graph import func_kind, graph_funcs
from sexpgpu.dialects.kern import KERNEL_KINDS
from sexpgpu.passes.manager import run_pipeline
from sexpgpu.passes.roofline import (
    GPUS,
    MODELLED_KINDS,
    estimate,
    gpu_named,
    launch_costs,
    launch_time,
    stacking_on,
    step_calls,
)
from sexpgpu.tools.explain_cmd import compile_unit

from sexpgpu.targets import register_targets

ROOT = Path(__file__).resolve().parents[2]
#: examples/tiny-gpt.sx --variant smoke, f32: batch 4, seq 16, width 32, 4 heads, MLP 128, vocabulary 256.
B, T, C, HIDDEN, VOCAB = 4, 16, 32, 128, 256
F32 = 4


@pytest.fixture(scope="module")
def train_costs() -> list[dict]:
    """Every launch of tiny-gpt's smoke train graph after the CUDA lowering's target-independent passes."""
    register_targets()
    unit = compile_unit(str(ROOT / "examples" / "tiny-gpt.sx"), "smoke", [])
    run_pipeline(unit, "match-patterns,fuse,plan-buffers")
    kernels = {op.attributes["sym_name"]: op for op in unit.module.body.ops if op.name == "kern.kernel"}
    train = next(f for f in graph_funcs(unit.module) if func_kind(f) == "train")
    return launch_costs(train, kernels)


def first(costs: list[dict], kernel_prefix: str, path: str) -> dict:
    return next(c for c in costs if c["kernel"].startswith(kernel_prefix) and c["path"] == path)


def test_a_gemm_reads_its_operands_and_bias_and_writes_its_product(train_costs) -> None:
    qkv = first(train_costs, "gemm", "model.blocks.0.attn.qkv")
    # x [64, 32] · W [32, 96] + bias [96] -> [64, 96], all f32.
    assert qkv["bytes"] == F32 * (B * T * C + C * 3 * C + 3 * C + B * T * 3 * C)
    assert qkv["flops"] == 2 * (B * T) * (3 * C) * C
    assert qkv["gemm"] and qkv["math"] == "f32"


def test_a_row_program_reads_and_writes_whole_rows(train_costs) -> None:
    norm = first(train_costs, "layernorm_f32", "model.blocks.0.norm1")
    # x [64, 32], weight and bias [32] in; y [64, 32], mean and rstd [64] out; llm.c's 8 operations an element.
    assert norm["bytes"] == F32 * (B * T * C + 2 * C + B * T * C + 2 * B * T)
    assert norm["flops"] == 8 * B * T * C
    assert not norm["gemm"] and norm["math"] is None


def test_a_gather_reads_the_rows_its_indices_name(train_costs) -> None:
    embed = first(train_costs, "pointwise_add", "model")
    # Token ids [4, 17] i32 (the 16 inputs of each record), the 64 table rows they name of [256, 32], the
    # positions [16, 32] once; one add an element into [4, 16, 32] f32. The whole table would be 32 KiB.
    tokens, rows, positions, out = B * T * 4, B * T * C * F32, T * C * F32, B * T * C * F32
    assert embed["bytes"] == tokens + rows + positions + out
    assert embed["bytes"] < VOCAB * C * F32 + out
    assert embed["flops"] == B * T * C


def test_a_fused_pointwise_kernel_counts_each_body_op_per_element(train_costs) -> None:
    gelu = first(train_costs, "pointwise_mul_erf_add", "model.blocks.0.mlp")
    # GELU's forward reads the fc output [64, 128] once and writes the activation [4, 16, 128] only (the
    # backward recomputes the rest); its body: x·(1/√2), erf, +1, x·½, the product: 5 ops.
    elements = B * T * HIDDEN
    assert gelu["bytes"] == F32 * (elements + elements)
    assert gelu["flops"] == 5 * elements
    # Its backward reads the pre-activation and the activation's gradient, writes the pre-activation's
    # gradient and the fc bias's [128]: nothing the forward saved besides the fc output.
    backward = first(train_costs, "reduction_mul_erf_add", "model.blocks.0.mlp")
    assert backward["bytes"] == F32 * (3 * elements + HIDDEN)


def test_a_fused_attention_moves_its_operands_once_and_computes_up_to_the_diagonal(train_costs) -> None:
    heads, d = 4, C // 4
    row = B * heads * T * d * F32  # one of q, k, v, o, do, dq, dk, dv
    stat = B * heads * T * F32  # lse or delta
    lower = B * heads * T * (T + 1) // 2  # causal query-key pairs
    forward = first(train_costs, "attention_forward", "model.blocks.0.attn")
    assert forward["bytes"] == 4 * row + stat  # q, k, v read; o, lse written
    assert forward["flops"] == 2 * 2 * d * lower  # scores and P·V, the masked half skipped
    assert forward["model_flops"] == 2 * 2 * d * B * heads * T * T  # what MFU counts: the full products
    assert forward["math"] is None  # f32 storage: the FMA kernel, not the tensor cores
    dkdv = first(train_costs, "attention_backward_f32_d8_attention_dkdv", "model.blocks.0.attn")
    assert dkdv["bytes"] == 4 * row + 2 * stat + 2 * row  # q, k, v, do, lse, delta read; dk, dv written
    assert dkdv["flops"] == 4 * 2 * d * lower  # scores, dP, dV, dK
    dq = first(train_costs, "attention_backward_f32_d8_attention_dq", "model.blocks.0.attn")
    assert dq["flops"] == 3 * 2 * d * lower  # scores, dP, dQ
    assert dkdv["model_flops"] + dq["model_flops"] == 2 * forward["model_flops"]


def test_a_launch_takes_the_larger_bound_plus_its_launch_cost() -> None:
    h200 = GPUS["h200"]
    gemm = {"bytes": 3 * 4096 * 4096 * 2, "flops": 2 * 4096**3, "gemm": True, "math": "bf16"}
    time = launch_time(gemm, h200, captured=True)
    # 137 GFLOP at 70% of 989 TFLOP/s: 0.199 ms; its 100 MB at 4.8 TB/s: 0.021 ms; plus 1 µs.
    assert time["compute"] == pytest.approx(2 * 4096**3 / (0.7 * 989e12))
    assert time["memory"] == pytest.approx(100663296 / 4.8e12)
    assert time["total"] == pytest.approx(time["compute"] + 1e-6)
    copy = {"bytes": 2 * 10**9, "flops": 0, "gemm": False, "math": None}
    assert launch_time(copy, h200, captured=False)["total"] == pytest.approx(2e9 / 4.8e12 + 4e-6)


def document(microbatches: int, chosen: int | None, planned: int | None) -> dict:
    """A lowering document with one launch per row: a bf16 GEMM in each train row, a copy in the update."""
    gemm = {"kernel": "gemm", "kind": "gemm", "path": "model.fc", "bytes": 10**6, "flops": 10**12, "gemm": True, "math": "bf16",
            "model_flops": 10**12}
    update = {"kernel": "update", "kind": "multi_tensor_update", "path": None, "bytes": 10**9, "flops": 10**6, "gemm": False, "math": None,
              "model_flops": 0}
    rows = [{"name": name, "kind": kind, "kernels": 1, "captured": None, "launch_costs": [cost]}
            for name, kind, cost in (("train", "train", gemm), ("train accumulating", "train_accumulating", gemm),
                                     ("train stacked", "train_stacked", gemm), ("eval", "evaluation", gemm),
                                     ("update default", "update", update))]
    return {"rows": rows, "stacking": {"microbatches": microbatches, "ranks": 1, "chosen": chosen, "planned": planned}}


def test_a_step_calls_the_rows_a_training_step_runs() -> None:
    assert step_calls(document(8, None, None)) == {"train": 1, "train accumulating": 7, "train stacked": 0,
                                                  "update default": 1}
    assert step_calls(document(8, None, 2))["train stacked"] == 4
    assert step_calls(document(8, 8, 2)) == {"train": 0, "train accumulating": 0, "train stacked": 1,
                                            "update default": 1}


def test_the_step_adds_its_calls_and_takes_mfu_from_the_gemm_flops() -> None:
    a100 = GPUS["a100"]
    result = estimate(document(8, None, 4), a100, tokens_per_step=8000)
    gemm_s = 10**12 / (0.7 * 312e12) + 4e-6  # one launch a call, not captured (below 16 kernels)
    update_s = 10**9 / 2.039e12 + 4e-6
    assert result["step_ms"] == pytest.approx((2 * gemm_s + update_s) * 1e3)
    assert result["launches"] == 3 and result["bytes"] == 2 * 10**6 + 10**9
    assert result["mfu"] == pytest.approx(2 * 10**12 / ((2 * gemm_s + update_s) * 312e12))
    assert result["tokens_per_second"] == pytest.approx(8000 / (2 * gemm_s + update_s))
    assert sum(result["shares"].values()) == pytest.approx(1)
    assert result["shares"]["launch"] == pytest.approx(3 * 4e-6 / (2 * gemm_s + update_s))
    assert result["rows"]["eval"] == {"ms": pytest.approx(gemm_s * 1e3), "calls": 0, "captured": False}
    assert [(t["row"], t["ms_per_step"]) for t in result["top"]] == [
        ("train stacked", pytest.approx(2 * gemm_s * 1e3)), ("update default", pytest.approx(update_s * 1e3))]


def test_the_stacking_a_gpu_chooses_fits_its_memory() -> None:
    h100 = GPUS["h100"]  # 80 GB
    assert stacking_on(h100, [8, 4, 2, 1], 2 * 10**9, 6 * 10**9) == 8
    assert stacking_on(h100, [8, 4, 2, 1], 2 * 10**9, 12 * 10**9) == 4
    assert stacking_on(h100, [8, 4, 2, 1], 2 * 10**9, 90 * 10**9) == 1


def test_every_kernel_kind_has_a_flop_model() -> None:
    """A kind added to the kern dialect (fused attention) needs its FLOPs in passes/roofline.py: until then
    the estimate counts its bytes alone and names it (`unmodelled`), and this test says so."""
    assert MODELLED_KINDS == set(KERNEL_KINDS)


def test_an_unmodelled_kind_is_named_by_the_estimate() -> None:
    doc = document(1, None, None)
    doc["rows"][0]["launch_costs"].append({"kernel": "sort_keys", "kind": "sort", "path": "model.embed",
                                           "bytes": 10**6, "flops": 0, "gemm": False, "math": None, "model_flops": 0})
    assert estimate(doc, GPUS["h200"], None)["unmodelled"] == ["sort"]
    assert estimate(document(1, None, None), GPUS["h200"], None)["unmodelled"] == []


def test_the_model_keeps_the_executors_capture_rule_and_reserve() -> None:
    from sexpgpu.backends.cuda import executable, executor
    from sexpgpu.passes import roofline

    assert roofline.CAPTURE_MIN_KERNELS == executable.CAPTURE_MIN_KERNELS
    assert roofline.RESERVED_BYTES == executor.RESERVED_BYTES


def test_a_gpu_the_table_lacks_is_one_line_and_exit_1() -> None:
    result = subprocess.run([sys.executable, "-m", "sexpgpu.tools.main", "explain", "examples/tiny-gpt.sx",
                             "--device", "cuda", "--target", "sm_90", "--gpu", "b200"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1
    assert result.stderr == "error: --gpu must be one of h200, h100, a100, not b200\n"
    assert result.stdout == ""


def test_a_device_is_found_in_the_table_by_its_cuda_name() -> None:
    """The benchmarks read the table too: a device's CUDA name finds its SXM board, another board none."""
    assert gpu_named("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_named("NVIDIA H200") is GPUS["h200"]
    assert gpu_named("NVIDIA A100-SXM4-80GB") is GPUS["a100"]
    assert gpu_named("NVIDIA H100 PCIe") is None
    assert gpu_named("NVIDIA A100-PCIE-40GB") is None
    assert gpu_named("NVIDIA GeForce RTX 4090") is None
    assert gpu_named(None) is None
