"""The pass manager: passes registered by name, pipelines parsed from strings.

A pipeline transforms one `CompilationUnit`. For a `.sx` file the unit starts
as source text: `read` makes forms, `macro-expand` expands them, `evaluate`
builds the `builtin.module` holding the experiment; graph passes then rewrite
that module and a dump pass (`explain`, `ir-json`, `print-values`) writes a
report to `unit.out`.
"""

from __future__ import annotations

import importlib
import io
import sys
import time
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import attrs
from attrs import define, field

from ..diagnostics import DiagnosticSink, SxError, UsageError, nearest

if TYPE_CHECKING:
    from ..frontend.experiment_definitions import ExperimentDefinition


@define
class LoweringPassFacts:
    """What the CUDA lowering's passes leave for the lowering document (`passes/lowering_report.py`) and the
    executor; each field None until the pass that writes it ran. Per-graph entries are plain data: they
    flow into the document (`explain --json`'s `device`) as they are."""

    #: match-patterns: graph -> family -> {"group", "direction", "kernels", "fired", "paths", "as",
    #: "fell_back"}; None when the pipeline ran no match-patterns (patterns off).
    patterns: dict[str, dict[str, dict[str, Any]]] | None = None
    #: fuse: graph -> {"nodes", "kernels", "launches", "gemms", "fused_groups"}.
    graphs: dict[str, dict[str, Any]] | None = None
    #: fuse: optimizer group -> {"graphs", "nodes"} of the update graphs one kernel replaced.
    updates: dict[str, dict[str, Any]] = field(factory=dict)
    #: fuse: what was not lowered as asked ({"graph", "family", "path", "reason"}).
    fell_back: list[dict[str, Any]] = field(factory=list)
    #: fuse: the module's distinct kernels.
    kernels: int | None = None
    #: plan-buffers: each graph's transient arena, and the persistent arena, in bytes.
    arenas: dict[str, int] = field(factory=dict)
    persistent_bytes: int = 0


@define
class UnitFacts:
    """What passes leave on a unit for later passes and the reports, one field per pass that writes it (as
    MLIR's analyses are typed results, not a string-keyed map): a misspelt fact fails where it is read."""

    #: evaluate: the evaluated experiment (knob docs, variants, loaders, warnings).
    experiment: ExperimentDefinition | None = None
    #: insert-casts: casts added per graph; the ops kept in f32 ({"graph", "op", "path"}); the policy applied.
    casts: dict[str, int] = field(factory=dict)
    kept_f32: list[dict[str, Any]] = field(factory=list)
    cast_policy: str | None = None
    #: plan-memory: graph -> its activation bound {"peak_bytes", "param_bytes", "grad_bytes", ...}.
    memory: dict[str, dict[str, int]] = field(factory=dict)
    #: The CUDA lowering's passes; None until one ran.
    lowering: LoweringPassFacts | None = None

    def lowering_facts(self) -> LoweringPassFacts:
        """The CUDA lowering's facts, made empty by the first lowering pass that writes one."""
        if self.lowering is None:
            self.lowering = LoweringPassFacts()
        return self.lowering


@define
class CompilationUnit:
    """What a pipeline transforms: a file's text, its forms, its IR module."""

    path: str | None = None
    text: str | None = None
    #: Top-level data after `read` / `macro-expand`.
    forms: list[Any] | None = None
    #: The `builtin.module` after `evaluate` or after parsing textual IR.
    module: Any = None
    variant: str | None = None
    sets: list[str] = field(factory=list)
    #: Where dump passes write their report.
    out: TextIO = field(factory=lambda: sys.stdout)
    #: Facts passes leave for later passes and reports (casts added, memory bound, ...).
    facts: UnitFacts = field(factory=UnitFacts)
    #: Whether a dump pass wrote the output (so the tool does not also print the IR).
    dumped: bool = False
    #: The errors, warnings and notes the passes raised, in order (the error that stopped the pipeline last).
    diagnostics: DiagnosticSink = field(factory=DiagnosticSink)

    def require_module(self, pass_name: str) -> Any:
        """The IR module, or a user error saying `pass_name` needs `evaluate` (or textual IR) first."""
        if self.module is None:
            raise SxError(f"{pass_name} needs IR: run 'evaluate' first on a .sx file")
        return self.module

    def op_count(self) -> int:
        if self.module is not None:
            return sum(1 for _ in self.module.walk()) - 1
        if self.forms is not None:
            return len(self.forms)
        return 0

    def printable(self) -> str:
        """The unit's current IR as text: the module, else the forms."""
        if self.module is not None:
            from ..dialects.printer import print_module

            return print_module(self.module)
        if self.forms is not None:
            from ..frontend.printing import show_form

            return "".join(show_form(f) + "\n" for f in self.forms)
        return self.text or ""


class Pass:
    """A named transformation of a compilation unit.

    Subclasses are attrs classes whose fields are the pass options (written
    `name{opt=value}` in a pipeline); `run` transforms the unit in place.
    """

    name: ClassVar[str]
    #: A one-line summary for `sexpgpu-opt --help`.
    summary: ClassVar[str] = ""

    def run(self, unit: CompilationUnit) -> None:
        raise NotImplementedError

    def final_output(self, unit: CompilationUnit) -> str | None:
        """What a tool prints instead of the IR when this pass ends the pipeline (None: the IR).
        A translation to another language (emit-cuda's CUDA C) is printed as such."""
        return None


class DumpPass(Pass):
    """A pass whose product is a report written to `unit.out`; the tool then prints no IR after it."""

    def run(self, unit: CompilationUnit) -> None:
        self.dump(unit)
        unit.dumped = True

    def dump(self, unit: CompilationUnit) -> None:
        raise NotImplementedError


#: The passes whose modules are imported, by name (each module registers its passes with `register_pass`).
PASSES: dict[str, type[Pass]] = {}

#: Every pass a pipeline may name, with the module that defines it (relative to `sexpgpu.passes`, or
#: absolute for a target's pass registered with `register_pass_module`). The registry is lazy, as MLIR
#: registers a pass by name with a constructor: reading a pipeline imports only the modules of the passes
#: it names, the first time it names them, so `check`'s pipeline imports neither the lowering passes nor
#: what they need (numpy, the patterns, a target's renderer). `test_pass_registry` keeps this table and
#: the modules' `register_pass` in step.
PASS_MODULES: dict[str, str] = {
    "accumulate": ".variants",
    "autodiff": ".autodiff",
    "build-updates": ".build_updates",
    "canonicalize": ".canonicalize",
    "cse": ".cse",
    "dce": ".dce",
    "diagnose": ".variants",
    "evaluate": ".evaluate",
    "explain": ".explain",
    "flatten-updates": ".flat_updates",
    "fold-constants": ".fold_constants",
    "fuse": ".fuse",
    "gemm-layouts": ".gemm_layouts",
    "insert-casts": ".insert_casts",
    "ir-json": ".ir_json",
    "lower-cpu": ".lower_cpu",
    "macro-expand": ".macro_expand",
    "match-patterns": ".match_patterns",
    "plan-buffers": ".plan_buffers",
    "plan-memory": ".plan_memory",
    "print-values": ".print_values",
    "read": ".read",
    "stack": ".variants",
    "stack-variants": ".variants",
    "verify": ".verify",
    "working-copies": ".working_copies",
}  # fmt: skip


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator making a pass available by its name in pipelines."""
    if cls.name in PASSES:
        raise ValueError(f"pass {cls.name} registered twice")
    PASSES[cls.name] = cls
    return cls


def register_pass_module(name: str, module: str) -> None:
    """Make pass `name` available to pipelines, defined by `module` (absolute), imported on first use:
    how a target outside `passes/` adds its lowering passes (`sexpgpu.targets`) without importing them."""
    known = PASS_MODULES.setdefault(name, module)
    if known != module:
        raise ValueError(f"pass {name} registered twice ({known} and {module})")


def pass_names() -> list[str]:
    """The name of every pass a pipeline may name, imported or not, sorted."""
    return sorted(PASS_MODULES.keys() | PASSES.keys())


def pass_class(name: str) -> type[Pass]:
    """The pass registered as `name`, importing its module on first use; unknown names are a UsageError."""
    if name not in PASSES and name in PASS_MODULES:
        importlib.import_module(PASS_MODULES[name], __package__)
    if name not in PASSES:
        hint = nearest(name, pass_names())
        raise UsageError(f"unknown pass '{name}'" + (f"; did you mean '{hint}'?" if hint else ""))
    return PASSES[name]


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _convert_option(pass_cls: type[Pass], attr: attrs.Attribute, raw: str) -> Any:
    default = attr.default.factory() if isinstance(attr.default, attrs.Factory) else attr.default  # type: ignore[arg-type]
    try:
        if isinstance(default, bool):
            if raw not in ("true", "false", "1", "0"):
                raise ValueError
            return raw in ("true", "1")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise UsageError(f"option '{attr.name}' of pass '{pass_cls.name}' takes a {type(default).__name__}, not '{raw}'") from None
    return raw


def parse_pipeline(text: str) -> list[Pass]:
    """`'canonicalize,cse,insert-casts{policy=bf16}'` → pass instances; unknown names are a UsageError."""
    pipeline = []
    for item in _split_top(text, ","):
        name, _, rest = item.partition("{")
        name = name.strip()
        cls = pass_class(name)
        options: dict[str, Any] = {}
        if rest:
            if not rest.endswith("}"):
                raise UsageError(f"unclosed options of pass '{name}'")
            fields = {a.name.replace("_", "-"): a for a in attrs.fields(cls)} if attrs.has(cls) else {}
            for opt in _split_top(rest[:-1], ","):
                key, eq, raw = opt.partition("=")
                key = key.strip()
                if not eq or key not in fields:
                    known = ", ".join(fields) or "none"
                    raise UsageError(f"pass '{name}' has no option '{key}' (options: {known})")
                options[fields[key].name] = _convert_option(cls, fields[key], raw.strip())
        pipeline.append(cls(**options))
    return pipeline


@define
class PassManager:
    """Runs a pipeline with the instrumentation `sexpgpu-opt` offers."""

    passes: list[Pass]
    print_before: set[str] = field(factory=set)
    print_after: set[str] = field(factory=set)
    print_after_all: bool = False
    verify_each: bool = False
    timing: bool = False
    #: Where instrumentation prints (IR dumps and timings).
    log: TextIO = field(factory=lambda: sys.stderr)
    timings: list[tuple[str, float, int, int]] = field(factory=list)

    def run(self, unit: CompilationUnit) -> None:
        from ..dialects.core import gc_paused

        # A pipeline's IR stays alive until it ends and its passes free little: cyclic collections
        # would only re-traverse the growing module (a third of GPT-2's training pipeline).
        with gc_paused(), unit.diagnostics.raising():
            self._run(unit)
        if self.timing:
            self.log.write(self.timing_report())

    def _run(self, unit: CompilationUnit) -> None:
        for p in self.passes:
            if p.name in self.print_before:
                self._dump(f"IR Dump Before {p.name}", unit)
            before = unit.op_count() if self.timing else 0
            start = time.perf_counter()
            p.run(unit)
            elapsed = time.perf_counter() - start
            if self.timing:
                self.timings.append((p.name, elapsed, before, unit.op_count()))
            if self.verify_each and unit.module is not None:
                unit.module.verify()
            if self.print_after_all or p.name in self.print_after:
                self._dump(f"IR Dump After {p.name}", unit)

    def _dump(self, title: str, unit: CompilationUnit) -> None:
        self.log.write(f"// -----// {title} //----- //\n{unit.printable()}\n")

    def timing_report(self) -> str:
        out = io.StringIO()
        total = sum(t for _, t, _, _ in self.timings)
        out.write("===-------------------------------------------------------------------------===\n")
        out.write("                         ... Pass execution timing report ...\n")
        out.write("===-------------------------------------------------------------------------===\n")
        out.write(f"  Total Execution Time: {total:.4f} seconds\n\n")
        out.write("   ----Wall Time----  ----Ops----  ----Name----\n")
        for name, t, before, after in self.timings:
            pct = 100.0 * t / total if total else 0.0
            out.write(f"   {t:.4f} ({pct:5.1f}%)  {before:>5} -> {after:<5}  {name}\n")
        out.write(f"   {total:.4f} (100.0%)                {'Total'}\n")
        return out.getvalue()


def run_pipeline(unit: CompilationUnit, pipeline: str) -> CompilationUnit:
    """Run a pipeline string on a unit (the API verbs use)."""
    PassManager(parse_pipeline(pipeline)).run(unit)
    return unit

