"""Training plans for the driver's tests."""

from __future__ import annotations

from sexpgpu.backends.training import TrainingPlan
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.pipelines import RUN_GRAPHS, TRAINING_PIPELINE


def training_plan(path: str, variant: str | None, sets: list[str], flat: bool = True) -> TrainingPlan:
    """The plan `sexpgpu run` trains; without `flat`, the run pipeline leaves out `flatten-updates`, so
    every parameter is updated and clipped by its own graphs."""
    passes = [TRAINING_PIPELINE, *(p for p in RUN_GRAPHS.split(",") if flat or p != "flatten-updates")]
    unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=list(sets)), ",".join(passes))
    return TrainingPlan(unit.module, path)
