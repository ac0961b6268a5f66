"""What the target-independent lowering passes ask of a kernel target, and the registry of targets.

`match-patterns` and `fuse` decide *what* becomes a kernel; how a kernel is
launched, and which dtypes and shapes a target's templates take, is the
target's answer. A target implements `KernelTarget` and registers itself with
`register_target`; the passes look it up by name (their `target` option,
`cuda` by default), so they import no backend. Two are built in: `cuda`
(`backends/cuda/target.py`) and `cpu-c` (`backends/cpu_c/target.py`, the
CUDA plan where a CPU task does not differ from a block); the tools layer
wires them in (`sexpgpu.targets.register_targets`), as `mlir-opt` registers
its dialects and passes in its `main`.

The interface follows tinygrad's `Renderer` (the scheduler asks the device's
renderer about widths and launch limits, never its code) and MLIR's GPU
target attributes (a target answers what the lowering may assume of it).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from ..diagnostics import UsageError
from ..dialects.core import TensorType


@frozen
class LaunchPlan:
    """How one kernel `fuse` makes is launched: the target's strategy, grid, block, dynamic shared bytes, the
    elements one thread handles with packed accesses (`vector`), and for a reduction split across blocks the
    chunks of its reduced extent (`split`), the scratch its blocks write their partial results to (one more
    output nothing reads) and its counters (one more input, i32 zeros the launch leaves zero)."""

    strategy: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int = 0
    vector: int = 1
    split: int = 1
    scratch: TensorType | None = None
    counters: TensorType | None = None

    def attributes(self) -> dict[str, Any]:
        """The `kern.kernel` attributes that record the plan."""
        attributes: dict[str, Any] = {"grid": list(self.grid), "block": list(self.block), "shared": self.shared}
        if self.vector > 1:
            attributes["vector"] = self.vector
        if self.split > 1:
            attributes["split"] = self.split
        return attributes


@frozen
class PatternKernel:
    """A pattern kernel as `match-patterns` chooses it: kind (`row`, `cross_entropy` or `attention`), family (or
    direction), row length (an attention's head dimension) and template options. Target-independent: the target
    says what it launches."""

    kind: str
    family: str
    cols: int
    options: Mapping[str, Any]

    def attributes(self) -> dict[str, Any]:
        """The symbol attributes that say which template and options (besides signature and launch shape)."""
        key = "family" if self.kind == "row" else "direction"
        length = {"row": "cols", "cross_entropy": "vocab", "attention": "head_dim"}[self.kind]
        return {key: self.family, length: self.cols, **self.options}


@frozen
class PatternStep:
    """One launch of a pattern kernel: the operands it reads and writes by name, its launch shape, and the
    name of its step (empty for the first, e.g. `column_sum` for a backward's second launch)."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    name: str


@frozen
class PatternLaunches:
    """What a pattern kernel launches for given operand dtypes and rows: its steps in order, and the bytes
    of each scratch buffer one step writes and a later one reads (f32)."""

    steps: tuple[PatternStep, ...]
    scratch: Mapping[str, int]


class KernelTarget(ABC):
    """The capabilities of a kernel target, as the target-independent lowering passes ask for them."""

    #: The name pipelines give (`fuse{target=cuda}`).
    name: str
    #: Float dtypes a pattern kernel's operands may be stored in.
    float_storage: tuple[str, ...]
    #: Integer dtypes a pattern kernel's index operands (a loss's targets) may be stored in.
    index_storage: tuple[str, ...]
    #: Head dimensions the target's fused attention kernels take; none when it has no attention kernel (then
    #: `match-patterns` leaves attention to its softmax row program and `fuse`).
    attention_head_dims: tuple[int, ...] = ()

    @abstractmethod
    def pattern_operands(self, kernel: PatternKernel) -> tuple[list[str], list[str]]:
        """The names of the kernel's inputs and outputs, in launch order."""

    @abstractmethod
    def pattern_launches(self, kernel: PatternKernel, dtypes: Mapping[str, str], sizes: Mapping[str, int]
                         ) -> PatternLaunches:
        """The launches of `kernel` with its operands in `dtypes` (by name) for its `sizes` (`rows` for a row
        program or the tail; `batch`, `heads`, `seq` for attention)."""

    @abstractmethod
    def plan_generated(self, kind: str, domain: Sequence[int], reduce_axes: Sequence[int],
                       maps: Sequence[Mapping[str, Any]], inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                       index_exprs: Sequence[Mapping[str, Any]] = (), arch: str = "",
                       accumulators: Sequence[str] = ()) -> LaunchPlan:
        """The launch of a generated kernel of `kind` over `domain` reading through `maps`, for the device
        architecture `arch` (empty: any; then no launch depends on the device's size). `accumulators`: the
        dtypes of the values a reduction's `kern.reduce`s reduce."""

    @abstractmethod
    def plan_template(self, kind: str, attributes: Mapping[str, Any]) -> tuple[LaunchPlan, dict[str, int], list[int]]:
        """The launch of a template kernel (`fill`, `copy`, `scatter_add`), its size arguments and the bytes
        of each scratch buffer."""


#: The targets whose modules are imported, by name.
TARGETS: dict[str, KernelTarget] = {}
#: Targets registered by the module that defines them (`register_target_module`), imported when a pass
#: first asks for one: reading a pipeline does not import a target's renderer.
TARGET_MODULES: dict[str, str] = {}


def register_target(target: KernelTarget) -> KernelTarget:
    """Make `target` available to the lowering passes by its name; registering one name twice is a bug."""
    known = TARGETS.setdefault(target.name, target)
    if known is not target:
        raise ValueError(f"kernel target {target.name} registered twice")
    return target


def register_target_module(name: str, module: str) -> None:
    """Make target `name` available, defined (and registered with `register_target`) by `module`, which is
    imported the first time a pass asks for the target."""
    known = TARGET_MODULES.setdefault(name, module)
    if known != module:
        raise ValueError(f"kernel target {name} registered twice ({known} and {module})")


def kernel_target(name: str) -> KernelTarget:
    """The registered target `name`; a usage error naming the registered ones otherwise."""
    if name not in TARGETS and name in TARGET_MODULES:
        importlib.import_module(TARGET_MODULES[name])
    target = TARGETS.get(name)
    if target is None:
        known = ", ".join(sorted(TARGETS.keys() | TARGET_MODULES.keys())) or (
            "none (sexpgpu.targets.register_targets() registers the built-in ones)")
        raise UsageError(f"no kernel target '{name}'; registered: {known}")
    return target
