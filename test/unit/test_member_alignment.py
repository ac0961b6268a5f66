"""Parameters, gradients and optimizer states start 256-byte aligned inside the arrays that hold a group's
members, whatever the sizes of the members before them, so vectorized kernels may take any member's view.

The experiment below has a bias of 4 and a parameter of 5 elements the loss never reads: before the
members were aligned, that parameter's zero gradient was written by `fill` (16-byte stores) at an
offset of 4 mod 16 bytes into the flat gradient array, and cuda-sim faulted (exit 3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.cuda.lowering import lower
from sexpgpu.backends.devices import open_device
from sexpgpu.backends.training import DeviceSetup, TrainingPlan, train
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module
from sexpgpu.passes.manager import CompilationUnit
from sexpgpu.passes.plan_buffers import member_offsets

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

EXPERIMENT = """\
(defknobs (lr 0.05) (hidden 6) (extra 5) (steps 2) (seed 3))
(def features 8)
(def classes 4)
(defloader train-loader
  :source (npy-file "data/blobs-train.npz")
  :fields ((x [features] f32) (label [] i32))
  :batch 8 :shuffle true :seed seed)
(defmodule classifier (inputs hidden outputs)
  (let ((input  (sub input (linear inputs hidden)))
        (output (sub output (linear hidden outputs)))
        (unused (param unused [extra] :init (normal 0.02))))
    (fn (x) (output (relu (input x))))))
(defmodel model (classifier features hidden classes))
(defn objective (batch)
  (let ((loss (cross-entropy (model (get batch :x)) (get batch :label))))
    (metric train/loss loss)
    loss))
(defoptimizer optimizer (adamw :lr lr))
(defrun :steps steps :loader train-loader :objective objective :optimizer optimizer :checkpoints none :seed seed)
"""


@pytest.fixture
def experiment(tmp_path: Path) -> Path:
    (tmp_path / "data").symlink_to(EXAMPLES / "data")
    path = tmp_path / "unused.sx"
    path.write_text(EXPERIMENT)
    return path


def test_member_offsets_align_every_member():
    assert member_offsets([5, 64, 1, 1], 64) == ([0, 64, 128, 192], 193)
    assert member_offsets([], 64) == ([], 0)


def test_flat_arrays_and_the_persistent_arena_align_every_member(experiment):
    plan = TrainingPlan.compile(str(experiment))
    setup = DeviceSetup(plan, open_device("cpu", "run"))
    assert len(setup.flat_bounds) == 5
    assert all(start % 64 == 0 for start, _ in setup.flat_bounds.values())  # 256 bytes of f32
    lowered = lower(CompilationUnit(module=parse_module(print_module(plan.module), "<copy>"))).module
    arenas = [op.attributes["arena"] for op in lowered.body.ops if op.name == "exp.param"]
    assert len(arenas) == 5 and all(set(arena) == {"param", "grad", "m", "v"} for arena in arenas)
    assert all(offset % 256 == 0 for arena in arenas for offset in arena.values())


def test_an_unread_parameter_after_an_odd_sized_one_trains_on_cuda_sim_as_on_the_cpu(experiment, tmp_path):
    cpu = train(str(experiment), out=tmp_path / "cpu", interactive=False, stream=open(tmp_path / "cpu.log", "w"))
    sim = train(str(experiment), out=tmp_path / "sim", device="cuda-sim", interactive=False,
                stream=open(tmp_path / "sim.log", "w"))
    assert (cpu.status, sim.status) == ("done", "done")
    np.testing.assert_allclose(sim.train_loss, cpu.train_loss, rtol=1e-5)
