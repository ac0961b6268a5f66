"""The executor interface: what a device offers the training driver and the Python API.

An executor compiles `graph.func` ops into callables and holds the arrays
they read and write. The driver (`backends/training.py`) knows nothing else
of a device: every computation on an array runs in a graph the executor
compiled, and arrays move only through the operations below (allocate,
upload, download, copy, view). An array is opaque: a numpy array for the
`cpu` executor (the numpy interpreter), a pointer into an arena for a GPU.

Executors are registered by device name, each with a probe saying in one line
why the device cannot open on this machine (no driver, no GPU):

    register_executor("cpu", InterpreterExecutor)
    executor = open_executor("cpu")
    graph = executor.compile(func)                  # an Executable
    result = graph({"x": executor.upload(x)}, out={"y": y})
    executor.download(result.outputs["y"])

docs/backends.md describes what a new backend implements.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attrs import frozen

from ..diagnostics import SxError

if TYPE_CHECKING:
    import numpy as np

    from ..dialects.core import Operation, TensorType
    from ..passes.lowering_report import LoweringFacts
    from .distributed import CollectivesPlan, Communicator, DeviceCollectives

#: How the layer above the executors renders their lowering facts as text (`sexpgpu.report.lowering_text`):
#: the training driver takes one to print a run's lowering report, since no backend renders a report.
LoweringText = Callable[["LoweringFacts"], str]

#: An executor's array. The driver never looks inside one: it passes arrays to graphs and to the
#: executor's array operations, and reads values on the host through `Executor.download`.
DeviceArray = Any


class GraphInput(Protocol):
    """One `graph.input` of a compiled graph: what a call must provide under `name`."""

    name: str
    #: The input's `role` attribute: "param", "batch", "grad", "state", "step", ...
    role: str
    type: TensorType


class ExecutionResult(Protocol):
    """What one call of an executable produced."""

    #: By the names of `graph.return`: the executor's arrays (the caller's, where `out` named one).
    outputs: dict[str, DeviceArray]
    #: `graph.metric` values by name, on the host (anything `float()` takes). Emitted values stay
    #: valid after later calls, so a driver may read them at the end of a step (one wait for a device).
    metrics: dict[str, Any]
    #: `graph.counter` values by name, as host numpy arrays.
    counters: dict[str, np.ndarray]
    #: `graph.observe` values by observation path, as host numpy values.
    observed: dict[str, np.ndarray]


class Executable(Protocol):
    """A compiled `graph.func`: named inputs in, named outputs out."""

    #: The graph's symbol name.
    name: str
    #: Its `graph.input` ops, in order.
    inputs: Sequence[GraphInput]

    @property
    def output_names(self) -> list[str]:
        """The names of `graph.return`, in order."""

    def __call__(self, inputs: Mapping[str, DeviceArray],
                 out: Mapping[str, DeviceArray] | None = None) -> ExecutionResult:
        """Run the graph on `inputs` (the executor's arrays, by input name).

        `out` maps output names to arrays of the output's shape and dtype that
        receive them; the result's `outputs` then holds those very arrays. An
        `out` array may be one of the inputs (an optimizer state updated in
        place): the executor gives the same result as if it were not. Outputs
        not in `out` are fresh arrays that later calls do not overwrite.
        """


class CompiledAhead:
    """Executables a device compiled before `compile` asked for them (the graphs of the stacking degree
    `stacking` chose, lowered together), by graph: `compile` returns them for those very graphs."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Operation, Executable]] = {}

    def keep(self, func: Operation, executable: Executable) -> None:
        self._by_id[id(func)] = (func, executable)

    def get(self, func: Operation) -> Executable | None:
        """What was compiled ahead for `func` (not for another graph since put at its address), or None."""
        found = self._by_id.get(id(func))
        return found[1] if found is not None and found[0] is func else None


class Executor(ABC):
    """A device that compiles graphs and holds their arrays; see the module docstring."""

    #: The device name it is registered under (`--device`).
    device: str
    #: Whether `stacking` may choose more than one microbatch a call: the driver then compiles the
    #: stacking variants for it (`passes.pipelines.STACK_VARIANTS`).
    stacks_microbatches: bool = False
    #: The lowering pipeline `compile` runs after the training pipeline (`passes/pipelines.py`), which says
    #: what the device fuses (`passes.match_patterns.fuses_attention`); None where graphs run as they are.
    lowering_pipeline: str | None = None

    @abstractmethod
    def compile(self, func: Operation) -> Executable:
        """Compile a `graph.func` (after the training pipeline) for this device."""

    @abstractmethod
    def zeros(self, shape: Sequence[int], dtype: str) -> DeviceArray:
        """A new array of `shape` and IR dtype (`"f32"`, `"i32"`, ...), every element zero."""

    @abstractmethod
    def upload(self, host: np.ndarray) -> DeviceArray:
        """A new array holding a copy of a host numpy array (same shape and dtype)."""

    @abstractmethod
    def download(self, array: DeviceArray) -> np.ndarray:
        """The array's value as a host numpy array. It may share the array's storage (on a host
        device), so the caller reads it before the array is next written and never writes to it."""

    @abstractmethod
    def copy(self, source: DeviceArray, target: DeviceArray) -> None:
        """Write `source`'s elements into `target` (same shape and dtype, not overlapping)."""

    @abstractmethod
    def view(self, flat: DeviceArray, offset: int, shape: Sequence[int]) -> DeviceArray:
        """The elements `offset`, `offset + 1`, ... of the 1-D array `flat` as an array of `shape`,
        sharing `flat`'s storage: what a graph writes there, `flat` holds."""

    # What follows has a default in terms of the methods above; a device overrides what it does better.

    def write(self, target: DeviceArray, host: np.ndarray) -> None:
        """Write a host array's values into `target` (same shape; converted to its dtype). The driver
        writes each batch into the same arrays every step, so a device's graphs read fixed addresses;
        `host` may change as soon as this returns."""
        self.copy(self.upload(host), target)

    def scalar(self, dtype: str) -> DeviceArray:
        """A rank-0 array the driver sets with `write` every step (the step number update graphs read):
        on a GPU, a device scalar a captured graph reads at a fixed address."""
        return self.zeros((), dtype)

    def stacking(self, microbatches: int, variants: Mapping[int, Sequence[Operation]]) -> int:
        """How many microbatches one call of a stacked train graph runs here: 1 or a degree of
        `variants`, the stacking variants the compiler made (`stack-variants`: degree k →
        `@train_stacked/<k>` and, below `microbatches`, its accumulating twin). A device compiles
        them (`compile` then returns what it made) and chooses the largest whose activations fit its
        memory. 1, the default, keeps one call per microbatch."""
        return 1

    def lowering_facts(self) -> LoweringFacts | None:
        """What the device made of the graphs compiled so far: the lowering document and the opened device's
        facts (`passes/lowering_report.py`), which `run` prints before its first step and `explain --device`
        shows (the top layer renders them: an executor renders no text); None where nothing is lowered
        (the interpreter)."""
        return None

    def collectives(self, world: Communicator) -> DeviceCollectives | None:
        """The device's own collectives over the ranks of `world` (NCCL on a GPU), or None: the
        gradients meet through host buffers and `world` (`distributed.HostStaging`)."""
        return None

    def planned_collectives(self, ranks: int) -> CollectivesPlan:
        """What `collectives` will choose for `ranks` ranks of this device on this machine, said before any
        rank starts (`explain --ranks`); by default MPI's, on the host arrays themselves."""
        from .distributed import CollectivesPlan

        return CollectivesPlan("MPI")


class ExecutorUnavailable(SxError):
    """A device with no executor in this build, or one whose probe says it cannot open here."""


class OutOfDeviceMemory(SxError):
    """An allocation the device cannot hold (the model or the batch is too large for it): a user error,
    raised by a device's executor. A training run that fails with it names its last checkpoint, which
    it leaves intact, so the run can resume from there on a device with more memory."""


#: A callable that returns None when the device can open here, else one line saying why not.
Probe = Callable[[], str | None]


@frozen
class _Registration:
    factory: Callable[..., Executor]
    probe: Probe | None


_EXECUTORS: dict[str, _Registration] = {}


def register_executor(device: str, factory: Callable[..., Executor], probe: Probe | None = None) -> None:
    """Make `open_executor(device, **options)` call `factory(**options)` when `probe` finds nothing
    missing. Each backend package registers its executor when imported."""
    if device in _EXECUTORS:
        raise ValueError(f"an executor for device {device!r} is already registered")
    _EXECUTORS[device] = _Registration(factory, probe)


def registered_devices() -> list[str]:
    return sorted(_EXECUTORS)


def unavailable_reason(device: str) -> str | None:
    """None when `device` can open; else why not, as the rest of "the <DEVICE> executor ...":
    "is not available in this build" (no executor registered) or "cannot open here: <the probe's line>"."""
    registration = _EXECUTORS.get(device)
    if registration is None:
        return "is not available in this build"
    missing = registration.probe() if registration.probe is not None else None
    return f"cannot open here: {missing}" if missing else None


def open_executor(device: str, **options: Any) -> Executor:
    """The executor of `device`, opened with its options; `ExecutorUnavailable` says why it cannot be."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise ExecutorUnavailable(f"the {device.upper()} executor {reason}")
    return _EXECUTORS[device].factory(**options)
