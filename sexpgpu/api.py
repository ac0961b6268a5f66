"""The Python API (verbs.md): compile an experiment file, inspect it, run its graphs.

    exp = sexpgpu.compile("my-run.sx", variant="smoke", set={"lr": 0.003})
    exp.selection        {knob: (value, source)}
    exp.parameters       {path: (shape, dtype, group)} in definition order
    exp.init_params()    {path: numpy array} from the run seed
    exp.run_graph("train", {**params, "tokens": batch})   loss, grads, metrics, counters
    exp.run_graph("eval", {...})                          an evaluation's metrics
    exp.report()         the explain document
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .diagnostics import SxError
from .dialects.core import Operation

if TYPE_CHECKING:
    from .backends.executor import Executable, Executor


class Experiment:
    """An experiment compiled through the training pipeline."""

    def __init__(self, path: str, variant: str | None = None, sets: dict[str, Any] | list[str] | None = None) -> None:
        from .backends.training import set_flags
        from .passes.manager import CompilationUnit, run_pipeline
        from .passes.pipelines import TRAINING_PIPELINE

        self.path = path
        self.unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=set_flags(sets)), TRAINING_PIPELINE)
        self.module: Operation = self.unit.module
        #: The Python-side experiment (knob docs, variants, loaders, warnings).
        self.definition = self.unit.facts.experiment
        ops = list(self.module.body.ops)
        self._graphs = {str(op.attributes["sym_name"]): op for op in ops if op.name == "graph.func"}
        self._evaluations = {str(op.attributes["name"]) for op in ops if op.name == "exp.evaluation"}
        self._params = [op for op in ops if op.name == "exp.param"]
        self._run = next(op for op in ops if op.name == "exp.run")
        self._compiled: dict[str, Executable] = {}
        self._executor: Executor | None = None

    @property
    def selection(self) -> dict[str, tuple[Any, str]]:
        """Each knob's selected value and its source: `default`, `variant` or `set`."""
        from .frontend.selection import plain_value

        return {name: (plain_value(value), source) for name, (value, source) in self.definition.selection.values.items()}

    @property
    def parameters(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        """Each parameter's shape, dtype and optimizer group, in definition order."""
        return {
            str(op.attributes["path"]): (tuple(op.attributes["type"].shape), op.attributes["type"].dtype, str(op.attributes["group"]))
            for op in self._params
        }

    @property
    def seed(self) -> int:
        return int(self._run.attributes["seed"])

    def init_params(self) -> dict[str, np.ndarray]:
        """Every parameter's initial value, a function of the run seed and its path only."""
        from .dialects.inits import initial_params

        return initial_params(self._params, self.seed)

    def run_graph(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run graph `name` on the `cpu` executor (the numpy interpreter).

        `"train"` returns `{"loss", "grads": {path: array}, "metrics", "counters"}`; an
        evaluation, named by its evaluation, returns its metrics.
        """
        from .backends.devices import open_device

        func = self._graphs.get(name)
        if func is None:
            raise SxError(f"the experiment has no graph '{name}' (graphs: {', '.join(self._graphs)})")
        if self._executor is None:
            self._executor = open_device("cpu", "run_graph")
        executor = self._executor
        graph = self._compiled.get(name)
        if graph is None:
            graph = self._compiled[name] = executor.compile(func)
        # Only what the graph reads goes to the device; a missing input is the graph's error to report.
        result = graph({spec.name: executor.upload(inputs[spec.name]) for spec in graph.inputs if spec.name in inputs})
        if name in self._evaluations:
            return dict(result.metrics)
        outputs = {key: executor.download(value) for key, value in result.outputs.items()}
        out: dict[str, Any] = {
            "grads": {key[len("grad/"):]: value for key, value in outputs.items() if key.startswith("grad/")},
            "metrics": dict(result.metrics),
            "counters": dict(result.counters),
        }
        if "loss" in outputs:
            out["loss"] = outputs["loss"]
        if result.observed:
            out["observed"] = dict(result.observed)
        return out

    def report(self) -> dict[str, Any]:
        """The explain document (what `sexpgpu explain --json` prints)."""
        from .report.document import build_document

        return build_document(self.module, self.unit.facts, self.path)


def compile(path: str, variant: str | None = None, set: dict[str, Any] | None = None) -> Experiment:  # noqa: A001
    """Compile the experiment at `path` under a selection (the variant, then `set` overrides)."""
    return Experiment(path, variant, set)
