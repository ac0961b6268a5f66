"""Training plans for the driver's tests."""

from __future__ import annotations

from sexpgpu.backends.training import TrainingPlan, experiment_fingerprint
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.pipelines import RUN_GRAPHS, TRAINING_PIPELINE


def training_plan(path: str, variant: str | None, sets: list[str], flat: bool = True) -> TrainingPlan:
    """The plan `sexpgpu run` trains; without `flat`, the run pipeline leaves out `flatten-updates`, so
    every parameter is updated and clipped by its own graphs."""
    unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=list(sets)), TRAINING_PIPELINE)
    fingerprint = experiment_fingerprint(unit.module)
    run_pipeline(unit, ",".join(p for p in RUN_GRAPHS.split(",") if flat or p != "flatten-updates"))
    return TrainingPlan(unit.module, path, fingerprint)
