"""Checkpoints: round trip, atomic replacement, verification of damaged checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from sexpgpu.backends.checkpoint import (
    PAUSE_ENV,
    list_checkpoints,
    read_checkpoint,
    remove_incomplete,
    resolve_checkpoint,
    write_checkpoint,
)

from sexpgpu.diagnostics import SxError


def tensors(scale: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    params = {"model.w": np.full((3, 4), scale, np.float32), "model.b": np.arange(4, dtype=np.float32)}
    states = {"model.w/m": np.full((3, 4), -scale, np.float32), "model.w/v": np.ones((3, 4), np.float32)}
    return params, states


def test_round_trip_keeps_tensors_and_manifest(tmp_path):
    params, states = tensors(0.5)
    path = write_checkpoint(tmp_path, 7, params, states, {"loaders": {"train": {"position": 28, "seed": 1}}})
    assert path == tmp_path / "checkpoints" / "step-7"
    loaded = read_checkpoint(path)
    assert loaded.step == 7
    assert loaded.manifest["loaders"]["train"]["position"] == 28
    assert set(loaded.manifest["files"]) == {"params.safetensors", "optimizer.safetensors"}
    for name, array in {**params, **states}.items():
        assert np.array_equal({**loaded.params, **loaded.states}[name], array)


def test_resolve_picks_the_latest_complete_checkpoint(tmp_path):
    for step in (5, 10):
        write_checkpoint(tmp_path, step, *tensors(step), {})
    (tmp_path / "checkpoints" / ".step-15.tmp-123").mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10]
    assert resolve_checkpoint(tmp_path).name == "step-10"
    assert resolve_checkpoint(tmp_path / "checkpoints" / "step-5").name == "step-5"
    remove_incomplete(tmp_path)
    assert not (tmp_path / "checkpoints" / ".step-15.tmp-123").exists()


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    write_checkpoint(tmp_path, 3, *tensors(1.0), {})
    write_checkpoint(tmp_path, 3, *tensors(2.0), {})
    assert read_checkpoint(tmp_path / "checkpoints" / "step-3").params["model.w"][0, 0] == 2.0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-3"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "params.safetensors").write_bytes(b"garbage"), "params.safetensors does not match"),
        (lambda p: (p / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is not valid JSON"),
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_problem_and_an_earlier_one(tmp_path, damage, message):
    write_checkpoint(tmp_path, 1, *tensors(1.0), {})
    path = write_checkpoint(tmp_path, 2, *tensors(2.0), {})
    damage(path)
    with pytest.raises(SxError) as err:
        read_checkpoint(path)
    assert message in err.value.message
    assert "step-2 is damaged" in err.value.message and "an earlier one is" in err.value.message


def test_resume_from_nothing_says_so(tmp_path):
    with pytest.raises(SxError, match="no such directory"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(SxError, match="holds no checkpoint"):
        resolve_checkpoint(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "fifo", tmp_path / "file"):
        with pytest.raises(SxError, match=f"cannot resume from {path}: it is not a directory"):
            resolve_checkpoint(path)


def test_killed_writer_leaves_the_previous_checkpoint_loadable(tmp_path):
    write_checkpoint(tmp_path, 1, *tensors(1.0), {})
    script = (
        "import sys, numpy as np\n"
        "from sexpgpu.backends.checkpoint import write_checkpoint\n"
        "write_checkpoint(sys.argv[1], 2, {'model.w': np.zeros((3, 4), np.float32)}, {}, {})\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env={**os.environ, PAUSE_ENV: "2:30"})
    deadline = time.time() + 20
    while not list((tmp_path / "checkpoints").glob(".step-2.tmp-*/params.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert resolve_checkpoint(tmp_path).name == "step-1"
    assert read_checkpoint(resolve_checkpoint(tmp_path)).params["model.w"][0, 0] == 1.0
    json.loads((tmp_path / "checkpoints" / "step-1" / "manifest.json").read_text())
