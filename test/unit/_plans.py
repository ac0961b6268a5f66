"""Training plans for the driver's tests."""

from __future__ import annotations

from sexpgpu.backends.training import TrainingPlan
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.pipelines import RUN_GRAPHS, TRAINING_PIPELINE


def training_plan(path: str, variant: str | None, sets: list[str], flat: bool = True) -> TrainingPlan:
    """The plan `sexpgpu run` trains; without `flat`, the run pipeline leaves out `flatten-updates`, so
    every parameter is updated and clipped by its own graphs."""
    graphs = RUN_GRAPHS if flat else ",".join(p for p in RUN_GRAPHS.split(",") if p != "flatten-updates")
    unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=list(sets)), f"{TRAINING_PIPELINE},{graphs}")
    return TrainingPlan(unit.module, path)
