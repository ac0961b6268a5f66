"""Resuming trusts nothing it did not write: edited manifests, mismatched tensors and torn logs.

A tiny experiment (synthetic tokens, two small parameters) trains four steps
with checkpoints at 2 and 4, in process through `backends.training.train`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.checkpoint import MANIFEST_FILE, read_checkpoint, write_checkpoint
from sexpgpu.backends.events import EventLog, read_events
from sexpgpu.backends.training import train

from sexpgpu.diagnostics import SxError

TINY = """\
(defknobs (lr 0.01) (width 4) (steps 4))
(defloader data :source (synthetic-tokens :vocab 16 :count 256 :seed 1) :fields ((tokens [5] i32)) :batch 2
  :shuffle true)
(defmodule net ()
  (let ((w (param w [width] :init ones)) (b (param b [2 width] :init zeros)))
    (fn (x) (* x (+ (sum w) (sum b))))))
(defmodel model (net))
(defn objective (batch) (mean (model (cast (get batch :tokens) f32))))
(defoptimizer opt (adamw :lr lr))
(defrun :steps steps :loader data :objective objective :optimizer opt :checkpoints (every 2))
"""


def quiet_train(path: Path, **kwargs):
    import io

    return train(str(path), stream=io.StringIO(), interactive=False, **kwargs)


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> tuple[Path, Path]:
    """The experiment file and a finished record of it (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("tiny")
    source = root / "tiny.sx"
    source.write_text(TINY)
    out = root / "record"
    assert quiet_train(source, out=out).status == "done"
    return source, out


def copy_of(record: tuple[Path, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(record[1], tmp_path / "record"))


def step_losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir / "events.jsonl") if e["type"] == "step"}


def edit_manifest(checkpoint: Path, edit) -> None:
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    edit(manifest)
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda m: m.update(step=3), id="step"),
        pytest.param(lambda m: m["loaders"]["data"].update(position=2), id="loader-position"),
        pytest.param(lambda m: m["selection"]["knobs"]["lr"].__setitem__(0, 0.02), id="selection"),
        pytest.param(lambda m: m["selection"].update(variant="smoke"), id="variant"),
        pytest.param(lambda m: m["files"].update({"params.safetensors": "0" * 64}), id="tensor-hash"),
    ],
)
def test_a_hand_edited_manifest_is_refused_and_changes_nothing(record, tmp_path, edit):
    run_dir = copy_of(record, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step-2"
    edit_manifest(checkpoint, edit)
    before = (run_dir / "events.jsonl").read_bytes()
    with pytest.raises(SxError, match=r"step-2 is damaged .*manifest.json does not match its checksum: it was "
                                      r"edited or damaged"):
        quiet_train(record[0], resume=checkpoint)
    assert (run_dir / "events.jsonl").read_bytes() == before


def test_an_untouched_manifest_still_resumes(record, tmp_path):
    run_dir = copy_of(record, tmp_path)
    edit_manifest(run_dir / "checkpoints" / "step-2", lambda m: None)  # rewritten, same content
    assert quiet_train(record[0], resume=run_dir / "checkpoints" / "step-2").status == "done"
    assert step_losses(run_dir) == step_losses(record[1])


def rewrite_tensors(checkpoint: Path, change) -> None:
    """Rewrite a checkpoint with changed tensors and a manifest that vouches for them (its own hashes and
    checksum): only the comparison with the experiment's parameters can refuse it."""
    loaded = read_checkpoint(checkpoint)
    params, states = dict(loaded.params), dict(loaded.states)
    change(params, states)
    written = {k: v for k, v in loaded.manifest.items() if k not in ("format", "version", "step", "files", "checksum")}
    write_checkpoint(checkpoint.parent.parent, loaded.step, params, states, written)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p, s: p.pop("model.b"), r"its tensors do not match the experiment's: it holds no parameter model\.b"),
        (lambda p, s: p.update({"model.b": np.zeros((1, 4), np.float32)}),
         r"parameter model\.b is \[1, 4\] there, \[2, 4\] here"),
        (lambda p, s: p.update({"model.w": np.zeros(4, np.float16)}), r"parameter model\.w is float16 there, float32 here"),
        (lambda p, s: s.pop("model.w/m"), r"it holds no optimizer state model\.w/m"),
        (lambda p, s: p.update({"model.extra": np.zeros(3, np.float32)}),
         r"it holds parameter model\.extra, which the experiment does not have"),
    ],
    ids=["missing", "reshaped", "dtype", "missing-state", "extra"],
)
def test_tensors_that_do_not_match_the_parameters_are_refused_naming_them(record, tmp_path, change, message):
    run_dir = copy_of(record, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step-2"
    rewrite_tensors(checkpoint, change)
    with pytest.raises(SxError, match=message):
        quiet_train(record[0], resume=checkpoint)


def test_a_torn_log_line_is_terminated_then_resumed_and_plotted(record, tmp_path):
    run_dir = copy_of(record, tmp_path)
    log = run_dir / "events.jsonl"
    lines = log.read_bytes().split(b"\n")
    # Killed while writing step 3's event: the log ends inside it.
    kept = b"\n".join(line for line in lines if b'"step": 3' not in line or b'"type": "step"' not in line)
    torn = b'{"type": "step", "time": 1.5, "step": 3, "loss": 24.8'
    log.write_bytes(kept.rstrip(b"\n") + b"\n" + torn)
    assert quiet_train(record[0], resume=run_dir / "checkpoints" / "step-2").status == "done"
    text = log.read_bytes()
    assert torn + b"\n" in text, "the torn line is terminated before the resumed run appends"
    assert step_losses(run_dir) == step_losses(record[1])
    pytest.importorskip("matplotlib")
    from sexpgpu.tools.plot_cmd import plot

    assert plot(run_dir, tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "torn",
    ['{"type": "step", "st', '{"type": "step", "step": 3, "loss": 1.', '{"type": "eval", "metrics": {"a": nu',
     '{"type": "end", "message": "x\\', '{"type": "step"'],
)
def test_torn_lines_anywhere_are_skipped_but_edited_lines_are_errors(tmp_path, torn):
    log = tmp_path / "events.jsonl"
    log.write_text('{"type": "start"}\n' + torn)
    EventLog(log).write("end", status="done")
    assert [e["type"] for e in read_events(log)] == ["start", "end"]
    log.write_text('{"type": "start"}\nstep 3 loss 1.5\n{"type": "end"}\n')
    with pytest.raises(SxError, match="not a run's event log: this line is not JSON") as err:
        read_events(log)
    assert str(err.value.loc).endswith("events.jsonl:2:1")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"type": "step", "step": "3", "loss": 1.5}', "this step event's step is not a step number"),
        ('{"type": "step", "step": 3, "loss": "low"}', "this step event's loss is not a number"),
        ('{"type": "eval", "step": 3, "metrics": [1.5]}', "this eval event's metrics are not numbers by name"),
        ('{"step": 3}', "this event has no type"),
    ],
)
def test_events_whose_fields_readers_rely_on_are_malformed_are_located_errors(tmp_path, line, message):
    log = tmp_path / "events.jsonl"
    log.write_text('{"type": "start"}\n' + line + "\n")
    with pytest.raises(SxError, match=f"not a run's event log: {message}") as err:
        read_events(log)
    assert str(err.value.loc).endswith("events.jsonl:2:1")


def test_plot_to_a_place_that_cannot_be_written_is_a_command_line_error(record, capsys):
    pytest.importorskip("matplotlib")
    from sexpgpu.tools.main import main

    assert main(["plot", str(record[1]), "-o", "/proc/no-such-dir/m.png"]) == 2
    assert "error: cannot write /proc/no-such-dir/m.png: No such file or directory" in capsys.readouterr().err
