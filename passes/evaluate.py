"""`evaluate`: the .sx file, under the unit's selection, to the experiment module.

Evaluates the unit's text (when it has one: a `--split-input-file` chunk or
standard input) or else `unit.path`, with the unit's variant and `--set`
overrides (the prelude first), then lowers the definition, tracing the run's
graphs; the module holds the `exp` ops and the `graph.func`s that
`dialects/exp.py` documents. The lowering's warnings go to `unit.diagnostics`.
The Python-side definition (`ExperimentDefinition`: knob docs, variants,
loaders, warnings, traces) is left in `unit.facts.experiment` for reports.
"""

from __future__ import annotations

import os
from typing import ClassVar

from attrs import define

from ..diagnostics import SxError
from ..dialects.core import gc_paused
from ..frontend.evaluator import Evaluator, run_deep
from ..frontend.experiment_lowering import ExperimentLowering
from .manager import CompilationUnit, Pass, register_pass


@register_pass
@define
class EvaluatePass(Pass):
    """Evaluates the unit's .sx file and traces its run into `unit.module`.

    Guarantees: the module holds the exp ops and graph.funcs the file defines
    under the unit's selection (and, with `inference`, `@sample` last); `unit.facts.experiment`
    holds the evaluated `ExperimentDefinition`.
    """

    name: ClassVar[str] = "evaluate"
    summary: ClassVar[str] = "evaluate the .sx file under the selection and trace its graphs"
    #: Also trace the model's forward for one sequence (`graph.func @sample`).
    inference: bool = False

    def run(self, unit: CompilationUnit) -> None:
        if unit.path is None:
            raise SxError("evaluate: the unit has no .sx file to evaluate")
        # Everything evaluation and tracing allocate stays alive: collections would only re-traverse it.
        with gc_paused():
            evaluator = Evaluator(variant=unit.variant, sets=unit.sets)
            if unit.text is not None:
                evaluator.sources[os.path.abspath(unit.path)] = unit.text
            evaluator.eval_file(unit.path)
            definition = evaluator.experiment  # type: ignore[attr-defined]
            lowering = ExperimentLowering(definition, unit.diagnostics)
            unit.module = run_deep(lambda: lowering.module(unit.path))
            if self.inference:
                unit.module.body.append(run_deep(lowering.inference))
        unit.facts.experiment = definition
