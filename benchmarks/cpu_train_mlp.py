"""CPU training throughput on a model that is not a GPT: `examples/mlp-classifier.sx` against PyTorch eager.

    python benchmarks/cpu_train_mlp.py [--threads N] [--steps 20] [--set KNOB=VALUE ...]

The bundled MLP (linear layers and ReLU, softmax cross-entropy, SGD with momentum,
coupled weight decay and a linear warmup, an accuracy metric) at a size where a
step is work rather than call overhead: by default `hidden=1024 depth=4 batch=512`
(about 3.2 M parameters; `--set` overrides, e.g. `--set batch=32 hidden=64` for the
example as written). The same model is written independently in PyTorch from the
same parameters, on the same records in the same order, with `torch.optim.SGD`
and the experiment groups' hyperparameters; the first step's losses are compared
(so the sides train the same thing) and then the steps of the interpreter (`cpu`),
`cpu-c` and PyTorch take turns (`benchmarks/cpu_train.py`'s harness and thread
settings), each side's median step reported with its process CPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_train import ROOT, alternating, set_threads  # noqa: E402

EXAMPLE = ROOT / "examples" / "mlp-classifier.sx"
SIZE = ["hidden=1024", "depth=4", "batch=512"]


class TorchMLP:
    """mlp-classifier.sx's classifier, loss, accuracy and optimizer groups in PyTorch eager."""

    def __init__(self, exp: Any, params: dict[str, Any]) -> None:
        import torch

        sys.path.insert(0, str(ROOT / "test" / "e2e"))
        from gpt_reference import schedule_lr

        #: The learning rate of a schedule at a step (`passes/schedules.py`'s meaning, written independently).
        self.schedule_lr = schedule_lr
        self.params = {path: torch.tensor(value, requires_grad=True) for path, value in params.items()}
        self.layers = self._prefixes()
        groups = [op.attributes for op in exp.module.body.ops if op.name == "exp.group"]
        self.schedules = []
        torch_groups = []
        for group in groups:
            hyper = group["hyper"]
            members = [self.params[m] for m in group["members"]] if "members" in group else list(self.params.values())
            self.schedules.append(hyper["lr"])
            torch_groups.append({"params": members, "lr": 0.0, "momentum": float(hyper["momentum"]),
                                 "nesterov": bool(hyper["nesterov"]), "weight_decay": float(hyper["weight_decay"])})
        self.optimizer = torch.optim.SGD(torch_groups)

    def _prefixes(self) -> list[str]:
        """The linear layers in the order the model applies them: input, layers.0 … layers.N, output."""
        hidden = sorted({p.rsplit(".", 1)[0] for p in self.params if p.startswith("model.layers.")},
                        key=lambda prefix: int(prefix.split(".")[2]))
        return ["model.input", *hidden, "model.output"]

    def _linear(self, prefix: str, x: Any) -> Any:
        return x @ self.params[f"{prefix}.weight"] + self.params[f"{prefix}.bias"]

    def train_step(self, batch: dict[str, Any], step: int) -> tuple[float, float]:
        """One SGD step on the batch; returns its loss and accuracy (the experiment's two metrics)."""
        import torch
        import torch.nn.functional as F

        x, label = torch.from_numpy(batch["x"]), torch.from_numpy(batch["label"]).long()
        self.optimizer.zero_grad(set_to_none=True)
        h = x
        for prefix in self.layers[:-1]:
            h = torch.relu(self._linear(prefix, h))
        logits = self._linear(self.layers[-1], h)
        loss = F.cross_entropy(logits, label)
        with torch.no_grad():
            picked = logits.gather(-1, label[:, None])
            accuracy = (picked >= logits.max(-1, keepdim=True).values).float().mean()
        loss.backward()
        for schedule, group in zip(self.schedules, self.optimizer.param_groups):
            group["lr"] = self.schedule_lr(schedule, step)
        self.optimizer.step()
        return float(loss.detach()), float(accuracy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    parser.add_argument("--set", dest="sets", nargs="*", default=[], metavar="KNOB=VALUE",
                        help=f"knobs over the default size {' '.join(SIZE)}")
    args = parser.parse_args()
    set_threads(args.threads)

    import torch
    from sexpgpu.backends.devices import open_device
    from sexpgpu.backends.loaders import Loader
    from sexpgpu.backends.training import Trainer, TrainingPlan

    torch.set_num_threads(args.threads)
    sets = SIZE + args.sets
    exp = TrainingPlan.compile(str(EXAMPLE), None, sets)
    record = Path("/nonexistent-benchmark-record")
    interpreter = Trainer(exp, record, None)
    compiled = Trainer(exp, record, None, executor=open_device("cpu-c", "benchmark", threads=args.threads))
    reference = TorchMLP(exp, {path: value.copy() for path, value in interpreter.params.items()})
    loader = Loader.from_op(exp.loader_ops[exp.train_loader_name])

    losses = {"interpreter": interpreter.train_step(1)[0], "cpu-c": compiled.train_step(1)[0],
              "pytorch eager": reference.train_step(loader.next_batch(), 1)[0]}
    spread = max(abs(loss - losses["interpreter"]) / abs(losses["interpreter"]) for loss in losses.values())
    steppers = {"interpreter": interpreter.train_step, "cpu-c": compiled.train_step,
                "pytorch eager": lambda step: reference.train_step(loader.next_batch(), step)}
    results = alternating(steppers, args.steps)
    records = interpreter.train_loader.batch
    print(f"model: examples/mlp-classifier.sx {' '.join(sets)}  ({exp.parameter_count:,} parameters, "
          f"{records} records per step, {args.threads} threads)")
    print("first step's loss: " + ", ".join(f"{side} {loss:.6f}" for side, loss in losses.items())
          + f"  (largest relative difference {spread:.1e})")
    for side, (wall, cpu) in results.items():
        print(f"{side:20} {records / wall:12,.0f} records/s  ({wall * 1000:.2f} ms per step, {cpu * 1000:.2f} ms CPU)")
    theirs, theirs_cpu = results["pytorch eager"]
    for side in ("interpreter", "cpu-c"):
        ours, ours_cpu = results[side]
        print(f"ratio {side + '/torch':17} {theirs / ours:.3f}  (by CPU time {theirs_cpu / ours_cpu:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
