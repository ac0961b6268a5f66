"""The Python-side records of an experiment: what the experiment forms define (language.md §3).

The forms (`experiment_forms`) make these records as a file is evaluated and
collect them in the session's `ExperimentDefinition`; the lowering
(`experiment_lowering`) then builds the experiment module from it. Each record
prints as `eval` shows it: `#<loader 1 fields, batch 4>`, `#<optimizer adamw>`,
`#<run 300 steps>`.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field

from ..diagnostics import Location
from .modules import ModelTree, Param
from .selection import Selection
from .tracer import Trace


@define
class Source:
    """A loader's source: `{kind, path | vocab count seed branch, …}` as the loader backend takes it."""

    kind: str
    options: dict[str, Any]

    def __sx_repr__(self) -> str:
        return f"#<source {self.kind}>"


@define
class FieldDef:
    name: str
    shape: tuple[int, ...]
    dtype: str


@define
class LoaderDef:
    name: str
    source: Source
    fields: list[FieldDef]
    batch: int
    shuffle: bool
    seed: int | None
    loc: Location | None

    def __sx_repr__(self) -> str:
        return f"#<loader {len(self.fields)} fields, batch {self.batch}>"


@define
class Schedule:
    """A learning-rate schedule as data; `build-updates` turns it into ops on the step."""

    kind: str
    options: dict[str, float]

    def __sx_repr__(self) -> str:
        return f"#<schedule {self.kind}>"


@define
class GroupSpec:
    glob: str
    hyper: dict[str, Any]
    loc: Location | None

    def __sx_repr__(self) -> str:
        return f"#<group {self.glob}>"


@define
class OptimizerSpec:
    kind: str
    hyper: dict[str, Any]
    clip: float | None
    groups: list[GroupSpec]
    loc: Location | None
    name: str = ""

    def __sx_repr__(self) -> str:
        return f"#<optimizer {self.kind}>"


@define
class DiagnosticSource:
    kind: str
    glob: str

    def __sx_repr__(self) -> str:
        return f'#<{self.kind} "{self.glob}">'


@define
class EvaluationDef:
    name: str
    loader: LoaderDef
    every: int
    fn: Any
    loc: Location | None

    def __sx_repr__(self) -> str:
        return f"#<evaluation {self.name}>"


@define
class DiagnosticDef:
    name: str
    of: DiagnosticSource
    reducer: str
    every: int
    when: bool
    loc: Location | None

    def __sx_repr__(self) -> str:
        return f"#<diagnostic {self.name}>"


@define
class Checkpoints:
    every: int

    def __sx_repr__(self) -> str:
        return f"#<checkpoints every {self.every}>"


@define
class RunDef:
    steps: int
    loader: LoaderDef
    microbatches: int
    prepare: Any
    objective: Any
    optimizer: OptimizerSpec
    evaluations: list[EvaluationDef]
    diagnostics: list[DiagnosticDef]
    checkpoints: int | None
    precision: str
    seed: int
    loc: Location | None
    #: Where each option was written, for errors about it.
    option_locs: dict[str, Location | None] = field(factory=dict)
    #: `:zero-stage` as written (None: not written; data-parallel ranks shard optimizer states, stage 1).
    zero_stage: int | None = None

    def __sx_repr__(self) -> str:
        return f"#<run {self.steps} steps>"


@define
class ExperimentDefinition:
    """Everything a file defines, in definition order; the lowering fills `groups` and `traces`."""

    selection: Selection
    tree: ModelTree
    loaders: dict[str, LoaderDef] = field(factory=dict)
    optimizers: dict[str, OptimizerSpec] = field(factory=dict)
    evaluations: dict[str, EvaluationDef] = field(factory=dict)
    diagnostics: dict[str, DiagnosticDef] = field(factory=dict)
    run: RunDef | None = None
    #: Warnings found while lowering, each (message, location), also reported to the unit's diagnostics.
    warnings: list[tuple[str, Location | None]] = field(factory=list)
    #: Parameter path -> optimizer group name, after lowering.
    groups: dict[str, str] = field(factory=dict)
    #: Graph name -> its trace, after lowering.
    traces: dict[str, Trace] = field(factory=dict)

    @property
    def params(self) -> dict[str, Param]:
        return self.tree.params
