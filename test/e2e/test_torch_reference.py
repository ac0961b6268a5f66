"""The spec GPT trained by sexpgpu and by an independent PyTorch model: the same losses.

Both start from the parameters sexpgpu initializes and see the same batches
(drawn by a second copy of the run's loader); PyTorch uses torch.optim.AdamW
and clip_grad_norm_. Twenty steps of f32 training must agree within 1e-4
relative, with and without gradient accumulation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gpt_reference import TorchGPT  # noqa: E402  (after the torch skip)
from sexpgpu.backends.loaders import Loader  # noqa: E402
from sexpgpu.backends.training import Trainer, TrainingPlan  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt.sx"
SPEC_GPT = EXAMPLE.with_name("gpt.sx")
STEPS = 20
RELATIVE_TOLERANCE = 1e-4


@pytest.mark.parametrize("microbatches", [1, 2])
def test_losses_match_pytorch(tmp_path, microbatches):
    # One torch thread: its spinning workers would fight numpy's BLAS threads for the cores.
    torch.set_num_threads(1)
    sets = [f"steps={STEPS}", "layers=2", "eval-every=1000", "checkpoint-every=1000", f"microbatches={microbatches}"]
    exp = TrainingPlan.compile(str(EXAMPLE), "smoke", sets)
    trainer = Trainer(exp, tmp_path, None)
    model = TorchGPT.from_experiment(exp, trainer.params)
    loader = Loader.from_op(exp.loader_ops[exp.train_loader_name])
    ours, theirs = [], []
    for step in range(1, STEPS + 1):
        ours.append(trainer.train_step(step)[0])
        theirs.append(model.train_step([loader.next_batch()["tokens"] for _ in range(microbatches)], step))
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= RELATIVE_TOLERANCE * abs(b), f"step {step}: sexpgpu {a}, torch {b}"
    assert ours[-1] < ours[0] - 0.3


def test_spec_gpt_smoke_matches_pytorch(tmp_path):
    """The spec's gpt.sx smoke variant (the benchmark's default): two optimizer groups, four microbatches."""
    torch.set_num_threads(1)
    exp = TrainingPlan.compile(str(SPEC_GPT), "smoke", [])
    trainer = Trainer(exp, tmp_path, None)
    model = TorchGPT.from_experiment(exp, trainer.params)
    loader = Loader.from_op(exp.loader_ops[exp.train_loader_name])
    for step in range(1, 6):
        ours = trainer.train_step(step)[0]
        theirs = model.train_step([loader.next_batch()["tokens"] for _ in range(exp.microbatches)], step)
        assert abs(ours - theirs) <= RELATIVE_TOLERANCE * abs(theirs), f"step {step}: sexpgpu {ours}, torch {theirs}"
