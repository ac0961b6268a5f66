"""Microbatches accumulated one a call (`train` then `train_accumulating`, no stacking) on `cuda-sim` and
`cpu-c` against the interpreter.

The accumulating graph adds each microbatch's embedding gradient straight into the gradient so far (the
scatter-add template with `accumulate`, written in place by the executor: only the rows the tokens name),
and the optimizer update computes the schedule's scalars in a one-element kernel before the multi-tensor
update. A narrowed `examples/gpt.sx --variant smoke` (four microbatches a step, f32) and tiny-gpt's smoke in
bf16 (three) train three steps on each device from the same parameters and batches: every loss within
1e-5 relative of the interpreter's in f32 (2e-2 in bf16), and so the embedding table after.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.cpu_c.compiler import missing_compiler
from sexpgpu.backends.cuda.graph_plan import GraphPlan
from sexpgpu.backends.devices import open_device
from sexpgpu.backends.training import Trainer, TrainingPlan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EMBEDDING = "model.embed.table"
#: A narrowed examples/gpt.sx (four microbatches a step, f32), and tiny-gpt's smoke in bf16 with three.
GPT = ("gpt.sx", ("layers=1", "width=32", "heads=2", "seq=16"))
TINY_BF16 = ("tiny-gpt.sx", ("microbatches=3", "precision=bf16"))


def trained(device: str, example: str, sets: tuple[str, ...], steps: int = 3
            ) -> tuple[list[float], dict[str, np.ndarray], Trainer]:
    """Losses of `steps` training steps of the example's smoke variant on `device`, one microbatch a call,
    and the parameters after."""
    plan = TrainingPlan.compile(str(EXAMPLES / example), "smoke", list(sets), stacking=False)
    trainer = Trainer(plan, Path("/nonexistent-record"), None, executor=open_device(device, "test"))
    assert trainer.stack == 1 and trainer.train_accumulating is not None
    losses = [trainer.train_step(step)[0] for step in range(1, steps + 1)]
    params = {path: np.array(trainer.executor.download(value), dtype=np.float32)
              for path, value in trainer.params.items()}
    return losses, params, trainer


@pytest.fixture(scope="module")
def interpreter() -> dict[tuple[str, tuple[str, ...]], tuple[list[float], dict[str, np.ndarray]]]:
    return {case: trained("cpu", *case)[:2] for case in (GPT, TINY_BF16)}


CASES = [pytest.param("cuda-sim", GPT, 1e-5, id="cuda-sim-gpt-f32"),
         pytest.param("cpu-c", GPT, 1e-5, id="cpu-c-gpt-f32"),
         pytest.param("cuda-sim", TINY_BF16, 2e-2, id="cuda-sim-tiny-gpt-bf16")]


@pytest.mark.parametrize("device, case, tolerance", CASES)
def test_accumulated_microbatches_train_as_the_interpreter(interpreter, device, case, tolerance, tmp_path,
                                                           monkeypatch):
    if device == "cpu-c" and missing_compiler() is not None:
        pytest.skip("no C compiler with OpenMP on this machine")
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    want_losses, want_params = interpreter[case]
    losses, params, trainer = trained(device, *case)
    for step, (want, got) in enumerate(zip(want_losses, losses), 1):
        assert abs(got - want) <= tolerance * abs(want), f"step {step}: loss {got} on {device}, {want} on cpu"
    # The embedding table, whose gradient the accumulating scatter sums. Not every parameter: AdamW makes an
    # lr-sized step of the rounding noise of a gradient that is zero in exact arithmetic (the key bias's,
    # which softmax does not see), so such parameters differ between any two summation orders.
    np.testing.assert_allclose(params[EMBEDDING], want_params[EMBEDDING], rtol=tolerance, atol=tolerance)
    if device == "cuda-sim":
        # The accumulated embedding gradient is the scatter's, which adds into the gradient so far and may
        # be written over it.
        plan: GraphPlan = trainer.train_accumulating.plan
        output = next(o for o in plan.outputs if o.name == f"grad/{EMBEDDING}")
        index = next(k for k, op in enumerate(plan.inputs) if op.attributes["name"] == f"grad/{EMBEDDING}")
        external = plan.externals[output.place.index]
        assert "scatter_add_into" in plan.steps[external.producer].function
        assert external.reads_in_place[index]
