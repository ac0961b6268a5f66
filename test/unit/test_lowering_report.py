"""The lowering report without a device: its document, its text with and without an opened device's
facts, the lowering cache, and a kernel NVRTC rejects (an internal error naming the kernel and its path).

The golden layouts are lit tests (test/lit/explain/cuda-*.test); these check what lit cannot: that a
warm report neither lowers nor compiles, that the executor's device facts change only what they
measure, and the exit status of a rejected kernel.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from sexpgpu.backends.cuda import lowering
from sexpgpu.passes.lowering_report import DeviceFacts, stacking_degrees
from sexpgpu.tools.explain_cmd import compile_unit
from sexpgpu.tools.main import main

from sexpgpu.report.lowering_text import render_lowering

FORMS = Path(__file__).resolve().parents[1] / "lit" / "explain" / "Inputs" / "forms.sx"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def document(cache):
    return lowering.lowering_report(compile_unit(str(FORMS), None, []), "sm_90", launches=True)


def test_device_facts_fill_what_was_not_measured(document):
    before = copy.deepcopy(document)
    device = DeviceFacts(name="NVIDIA H200", total_memory=150 << 30, free_memory=140 << 30, stacking=1,
                         captured=frozenset({"train"}))
    text = render_lowering(document, device)
    assert document == before, "render_lowering must not change the document it renders"
    lines = text.splitlines()
    assert lines[0] == "lowering: cuda compute_90 NVIDIA H200, patterns on"
    train = next(line for line in lines if line.startswith("  train "))
    assert train.endswith(", captured")
    assert not next(line for line in lines if line.startswith("  norms ")).endswith("captured")
    memory = next(line for line in lines if line.startswith("  memory "))
    assert "150.0 GiB, 140.0 GiB free; planned 5.0 KiB persistent" in memory
    assert next(line for line in lines if line.startswith("  stacking ")).split(None, 1)[1] == \
        "1, of 1: the largest whose activations fit"
    assert not any(line.startswith("  capture ") for line in lines)
    assert "not measured" not in text

    unmeasured = render_lowering(document)
    assert unmeasured.splitlines()[0] == "lowering: cuda compute_90 (device not measured), patterns on"
    assert "  capture                   not measured" in unmeasured


def test_pycuda_capture_off_is_said(document):
    text = render_lowering(document, DeviceFacts(name="GPU", capture_off="PyCUDA has no stream-capture API"))
    assert "  capture                   off: PyCUDA has no stream-capture API" in text.splitlines()


def test_launch_list_is_every_launch_of_the_first_graph(document):
    train = document["rows"][0]
    assert train["name"] == "train"
    assert len(train["launches"]) == train["kernels"]
    assert sum(launch["gemm"] is not None for launch in train["launches"]) == train["gemms"]
    text = render_lowering(document)
    assert "    launches:" in text


def test_warm_report_neither_lowers_nor_compiles(cache, monkeypatch):
    first = lowering.lowering_report(compile_unit(str(FORMS), None, []), "sm_90")
    assert list((cache / "lowering").rglob("*.json"))

    def refuse(*args, **kwargs):
        raise AssertionError("a warm report lowered or compiled")

    monkeypatch.setattr(lowering, "lower", refuse)
    monkeypatch.setattr(lowering, "compile_lowered", refuse)
    assert lowering.lowering_report(compile_unit(str(FORMS), None, []), "sm_90") == first
    # Another target is another document.
    with pytest.raises(AssertionError, match="a warm report"):
        lowering.lowering_report(compile_unit(str(FORMS), None, []), "sm_80")


def test_rejected_kernel_is_an_internal_error_naming_kernel_and_path(cache, monkeypatch, capsys):
    written = lowering.module_source

    def broken(module):
        # Break the body of the cross-entropy forward kernel: NVRTC rejects it, the error must say which.
        text = written(module)
        head = text.index('extern "C" __global__', text.index("cross_entropy_forward"))
        body = text.index("{", head) + 1
        return text[:body] + "\n    this_is_not_cuda;\n" + text[body:]

    monkeypatch.setattr(lowering, "module_source", broken)
    status = main(["explain", str(FORMS), "--device", "cuda", "--target", "sm_90"])
    err = capsys.readouterr().err
    assert status == 3
    assert "internal error" in err
    assert "NVRTC rejected the generated kernel" in err
    assert "(@cross_entropy_forward" in err and "(model path model)" in err
    assert "this_is_not_cuda" in err


def test_stacking_degrees_are_the_divisors_largest_first():
    assert stacking_degrees(8) == [8, 4, 2, 1]
    assert stacking_degrees(6) == [6, 3, 2, 1]
    assert stacking_degrees(1) == [1]
    assert stacking_degrees(8, ranks=2) == [4, 2, 1]
