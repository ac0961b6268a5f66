"""benchmarks/gpu_train.py without a GPU: its dry run end to end, and its figures from given timings.

The benchmark's GPU run is the device check's (tools/device-check). Here the
dry run proves the script: it builds GPT-2 small's plan (and, where this build
has it, the CUDA lowering and NVRTC's code for sm_90), trains the PyTorch model
one step on the CPU from sexpgpu's initial parameters, and prints and writes
its table with every GPU figure "not measured". The arithmetic of tokens/s,
MFU, ratios and loss agreement is checked on made-up timings.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_train  # noqa: E402  (after the path and the torch skip)

VOCAB = 50304


def test_the_dry_run_builds_trains_pytorch_one_step_and_measures_nothing_of_a_gpu(tmp_path):
    figures_path = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_train.py"), "--dry-run", "--json",
                           str(figures_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(figures_path.read_text())
    sides = figures["sides"]
    assert sides["sexpgpu"]["status"] == "built"
    assert "lowering_seconds" in sides["sexpgpu"] or sides["sexpgpu"]["lowering"].startswith("not measured")
    eager = sides["eager"]
    assert (eager["status"], eager["device_kind"], len(eager["losses"])) == ("done", "cpu", 1)
    # A model at its initial parameters predicts about uniformly over the padded vocabulary.
    assert abs(eager["losses"][0] - math.log(VOCAB)) < 0.05
    assert sides["compile"]["status"] == "not run"
    model = figures["summary"]["model"]
    assert (model["layers"], model["width"], model["heads"], model["seq"], model["vocab"]) == (1, 64, 2, 32, VOCAB)
    assert model["n"] == model["parameters"] - VOCAB * 64
    assert model["flops_per_token"] == 6 * model["n"] + 6 * 1 * 64 * 32
    assert model["tokens_per_step"] == 8 * 4 * 32
    assert "mfu" not in figures["summary"]["rows"]["eager"]
    assert "\n".join(figures["table"]) in done.stdout
    assert "sexpgpu         not measured: dry run builds only" in done.stdout
    assert "torch.compile   not measured: dry run" in done.stdout
    assert "bf16 dense peak not measured (unknown device); bf16 matmul measured not measured" in done.stdout


def test_gpt2_small_multiplies_with_llmc_s_parameter_count():
    """Without its token-embedding table (a lookup), GPT-2 small has llm.c's N: the tied table is its classifier."""
    from sexpgpu.backends.training import TrainingPlan

    model = gpu_train.model_figures(TrainingPlan.compile(str(gpu_train.EXAMPLE)))
    assert (model["parameters"], model["n"]) == (163_109_376, 124_475_904)
    assert model["flops_per_token"] == 6 * 124_475_904 + 6 * 12 * 768 * 1024
    assert model["tokens_per_step"] == 32768


def test_peaks_by_device_name():
    """From the step estimate's table of SXM boards: another board of the same chip has other figures."""
    assert gpu_train.peak_tflops("NVIDIA H200") == gpu_train.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_train.peak_tflops("NVIDIA H100 PCIe") is None
    assert gpu_train.peak_tflops("NVIDIA H100 NVL") is None
    assert gpu_train.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_train.peak_tflops("NVIDIA GeForce RTX 4090") is None
    assert gpu_train.peak_tflops(None) is None


def side(wall: float, losses: list[float], **more) -> dict:
    model = {"layers": 12, "width": 768, "heads": 12, "seq": 1024, "vocab": VOCAB, "precision": "bf16",
             "microbatches": 8, "batch": 4, "tokens_per_step": 32768, "parameters": 163_109_376, "n": 124_475_904,
             "flops_per_token": 803_478_528}
    return {"status": "done", "device_kind": "cuda", "device": "NVIDIA H200", "model": model,
            "step_seconds": [wall / 20] * 20, "timed_wall": wall, "losses": losses, **more}


def test_tokens_per_second_mfu_ratios_and_agreement_from_timings():
    sides = {
        "sexpgpu": side(2.0, [10.9, 10.0, 9.0, 8.0, 7.0, 6.0], compile_seconds=12.5),
        "eager": side(4.0, [11.0, 10.0, 9.0, 8.0, 7.0, 6.5], matmul_tflops=800.0),
        "compile": side(3.0, [11.0, 10.1, 9.0, 8.0, 7.0], compile_seconds=61.0),
    }
    summary = gpu_train.summarize(sides)
    rate = 32768 * 20 / 2.0
    row = summary["rows"]["sexpgpu"]
    assert row["tokens_per_s"] == pytest.approx(rate)
    assert row["ms_per_step"] == pytest.approx(100.0)
    assert row["mfu"] == pytest.approx(803_478_528 * rate / 989e12)
    assert row["of_matmul_ceiling"] == pytest.approx(803_478_528 * rate / 800e12)
    assert summary["ratios"] == {"sexpgpu/eager": pytest.approx(2.0), "sexpgpu/compile": pytest.approx(1.5)}
    # The first five steps against PyTorch eager's: the largest relative difference.
    assert summary["agreement"] == {"sexpgpu": pytest.approx(0.1 / 11.0), "compile": pytest.approx(0.1 / 10.0)}
    table = gpu_train.format_table(summary, sides, dry_run=False)
    assert "device NVIDIA H200; bf16 dense peak 989 TFLOP/s (datasheet); bf16 matmul measured 800 TFLOP/s" in table
    assert f"sexpgpu         cuda        {rate:,.0f}     100.0" in table
    assert f"{row['mfu']:7.1%}       12.5" in table
    assert "ratio sexpgpu/compile: 1.500" in table
    assert "first 5 losses, sexpgpu against pytorch eager: largest relative difference 9.09e-03 (within 0.02)" in table


def test_a_failed_side_keeps_the_others_figures():
    sides = {"sexpgpu": {"status": "failed", "error": "KernelLaunchError: kernel fused_3: ..."},
             "eager": side(4.0, [11.0])}
    summary = gpu_train.summarize(sides)
    assert "ratios" not in summary and summary["rows"]["eager"]["tokens_per_s"] == pytest.approx(32768 * 5)
    table = gpu_train.format_table(summary, sides, dry_run=False)
    assert "sexpgpu         KernelLaunchError: kernel fused_3: ..." in table
