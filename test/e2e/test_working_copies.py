"""The weights' bf16 working copies (`working-copies`, issue 18 item 4) change no number a run computes.

Under the bf16 policy the train and evaluation graphs read each weight's bf16
copy, which the optimizer's update writes, instead of casting the f32 master
every call. The copy is the cast's rounding of the same value, so on the CPU
a run with copies is bit-identical to one that casts (the run pipeline without
the pass); cuda-sim and cpu-c train as the interpreter within bf16's
tolerance; checkpoints hold no copies (they are made from the parameters on
resume), so a checkpoint resumes on every device, and one written by a run
that cast resumes where a run with copies continues.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from sexpgpu.backends.checkpoint import read_checkpoint
from sexpgpu.backends.events import read_events
from sexpgpu.backends.training import TrainingPlan, train
from sexpgpu.dialects.graph import func_kind, input_role
from sexpgpu.passes import pipelines
from sexpgpu.passes.working_copies import MAKER, READING_KINDS, ROLE, cast_parameter
from test_cuda_sim_run import EXPERIMENT, run, values

ROOT = Path(__file__).resolve().parents[2]
BF16 = EXPERIMENT.replace("(precision f32)", "(precision bf16)")
#: bf16 on another device than the interpreter: the kernels round their bf16 results at other points.
BF16_TOLERANCE = 2e-2


def assert_within(got: dict, want: dict, tolerance: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].keys() == want[key].keys(), key
        for name, value in want[key].items():
            assert got[key][name] == pytest.approx(value, rel=tolerance), (key, name)


def casting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run pipeline without `working-copies`: the graphs cast the masters, as before the pass."""
    monkeypatch.setattr(pipelines, "RUN_GRAPHS", pipelines.RUN_GRAPHS.replace(f"{pipelines.WORKING_COPIES},", ""))


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """The bf16 experiment trained eight steps (checkpoints at 4 and 8) with copies on the CPU, cuda-sim and
    cpu-c, and casting on the CPU."""
    root = tmp_path_factory.mktemp("working-copies")
    source = root / "tiny-bf16.sx"
    source.write_text(BF16)
    done: dict[str, tuple[Path, list[dict]]] = {"source": (source, [])}
    for device in ("cpu", "cuda-sim", "cpu-c"):
        done[device] = (root / device, run(source, root / device, device)[0])
    with pytest.MonkeyPatch.context() as monkeypatch:
        casting(monkeypatch)
        done["casting"] = (root / "casting", run(source, root / "casting", "cpu")[0])
    return done


def test_the_bf16_graphs_read_copies_and_the_f32_ones_cast_nothing(tmp_path):
    source = tmp_path / "tiny-bf16.sx"
    source.write_text(BF16)
    plan = TrainingPlan.compile(str(source))
    reading = [func for func in plan.graphs.values() if func_kind(func) in READING_KINDS]
    assert {func_kind(func) for func in reading} == {"train", "train_accumulating", "train_diagnosed", "evaluation"}
    for func in reading:
        assert not [op for op in func.body.ops if cast_parameter(op) is not None], func.attributes["sym_name"]
        copies = {op.attributes["name"] for op in func.body.ops if op.name == "graph.input" and input_role(op) == ROLE}
        assert "bf16/model.head.weight" in copies and "bf16/model.blocks.0.attn.qkv.weight" in copies
    assert MAKER in plan.graphs
    source.write_text(EXPERIMENT)
    assert MAKER not in TrainingPlan.compile(str(source)).graphs


def test_copies_train_bit_identically_to_casts_on_the_cpu(bf16_runs):
    assert values(bf16_runs["cpu"][1]) == values(bf16_runs["casting"][1])
    assert sorted(key for key in values(bf16_runs["cpu"][1]) if key[0] != "step") == [
        ("diagnostic", 4), ("diagnostic", 8), ("eval", 4), ("eval", 8)]


@pytest.mark.parametrize("device", ["cuda-sim", "cpu-c"])
def test_copies_train_on_the_compiled_devices_as_the_interpreter(bf16_runs, device):
    assert_within(values(bf16_runs[device][1]), values(bf16_runs["cpu"][1]), BF16_TOLERANCE)


def test_checkpoints_hold_the_f32_masters_and_no_copies(bf16_runs):
    for device in ("cpu", "cuda-sim", "cpu-c"):
        checkpoint = read_checkpoint(bf16_runs[device][0] / "checkpoints" / "step-4")
        casting = read_checkpoint(bf16_runs["casting"][0] / "checkpoints" / "step-4")
        assert checkpoint.params.keys() == casting.params.keys()
        assert checkpoint.states.keys() == casting.states.keys()
        assert checkpoint.manifest["fingerprint"] == casting.manifest["fingerprint"]
        assert {value.dtype.name for value in (*checkpoint.params.values(), *checkpoint.states.values())} == {"float32"}


@pytest.mark.parametrize(("origin", "device"), [("cpu", "cpu"), ("casting", "cpu"), ("cpu", "cuda-sim"),
                                                ("cuda-sim", "cpu"), ("cpu", "cpu-c")])
def test_a_checkpoint_resumes_with_its_copies_made_on_every_device(bf16_runs, tmp_path, origin, device):
    """The copies are made from the loaded masters: on the CPU the resumed run continues bit-identically (a
    checkpoint of the run that cast too); on another device than the checkpoint's, within bf16's tolerance."""
    source, _ = bf16_runs["source"]
    out, original = bf16_runs[origin]
    checkpoint = tmp_path / "from"
    shutil.copytree(out / "checkpoints" / "step-4", checkpoint)
    resumed, _ = run(source, tmp_path / "resumed", device, resume=checkpoint)
    want = {key: value for key, value in values(original).items() if key[1] > 4}
    if device == "cpu" and origin != "cuda-sim":
        assert values(resumed) == want
    else:
        assert_within(values(resumed), want, BF16_TOLERANCE)


def test_the_bundled_gpt_in_bf16_trains_with_copies_as_with_casts(tmp_path, monkeypatch):
    """`examples/gpt.sx --variant smoke` under the bf16 policy, three steps and an evaluation, four
    microbatches a step (stacked on cuda-sim): bit-identical to casting on the CPU, within bf16's tolerance
    of it on cuda-sim."""
    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples)
    gpt = examples / "gpt.sx"
    gpt.write_text(gpt.read_text().replace(":precision f32", ":precision bf16"))
    sets = ["steps=3", "layers=1"]
    found = {}
    for label, device in (("copies", "cpu"), ("sim", "cuda-sim")):
        found[label] = values(run_gpt(gpt, sets, tmp_path / label, device))
    casting(monkeypatch)
    found["casting"] = values(run_gpt(gpt, sets, tmp_path / "casting", "cpu"))
    assert sorted(found["copies"]) == [("eval", 3), ("step", 1), ("step", 2), ("step", 3)]
    assert found["copies"] == found["casting"]
    assert_within(found["sim"], found["copies"], BF16_TOLERANCE)


def run_gpt(gpt: Path, sets: list[str], out: Path, device: str) -> list[dict]:
    result = train(str(gpt), "smoke", sets, out=out, device=device, stream=io.StringIO(), interactive=False)
    assert result.status == "done", result.message
    return read_events(out / "events.jsonl")
