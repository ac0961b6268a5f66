"""The records a kernel template returns: one CUDA kernel (`KernelSource`) and a family's launches (`KernelProgram`).

A `KernelSource` is the text of one `extern "C" __global__` function with
what a launcher needs to know of it: its parameters in order (name, C type,
role, dtype), the launch shape for given sizes, the pointer alignment it
assumes and which outputs may be written over which inputs. A
`KernelProgram` is a family as it runs: its operands, and the kernels it
launches in order with the operands bound to each kernel's parameters (most
families are one kernel; a deterministic column sum is two, through a scratch
buffer). Nothing here runs anything: backends bind device addresses and sizes
to `KernelProgram.launches` and launch what it returns.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence

from attrs import field, frozen, validators

from ....dialects.core import DTYPE_BYTES

#: The C type of each storage dtype a template takes.
C_TYPES = {"f32": "float", "bf16": "__nv_bfloat16", "i32": "int", "i64": "long long"}
FLOAT_STORAGE = ("f32", "bf16")
INDEX_DTYPES = ("i32", "i64")
#: Parameter roles: pointers the kernel reads, writes, or uses as workspace, and scalars passed by value.
ROLES = ("input", "output", "scratch", "scalar")
#: Every pointer a packed kernel takes must be aligned to this many bytes (its widest access).
PACKED_ALIGNMENT = 16


@frozen
class KernelParam:
    """One parameter of a kernel or a program: its name, C type as declared, role and element dtype."""

    name: str
    ctype: str
    role: str = field(validator=validators.in_(ROLES))
    dtype: str

    @property
    def is_pointer(self) -> bool:
        return self.role != "scalar"


@frozen
class LaunchShape:
    """A launch's grid and block (x, y, z) and its dynamic shared memory in bytes."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


@frozen
class KernelSource:
    """One `extern "C" __global__` function, specialised, with its parameters and launch shape.

    `name` is unique per specialisation: kernels of equal names have equal
    code, so a translation unit keeps one of each. `code` is the function
    alone; it needs the prelude (`prelude.PRELUDE`) before it. `launch`
    gives the shape for the program's sizes (the scalar parameters by name).
    `alignment` is the byte alignment every pointer argument must have.
    `in_place` lists (output, input) pairs that may be the same buffer.
    """

    name: str
    family: str
    code: str
    params: tuple[KernelParam, ...]
    shape: Callable[[Mapping[str, int]], LaunchShape] = field(eq=False, repr=False)
    alignment: int = 4
    in_place: tuple[tuple[str, str], ...] = ()

    @property
    def dtypes(self) -> dict[str, str]:
        """The element dtype of each pointer parameter."""
        return {p.name: p.dtype for p in self.params if p.is_pointer}

    def launch(self, sizes: Mapping[str, int]) -> LaunchShape:
        """The grid, block and dynamic shared memory for these sizes."""
        return self.shape(sizes)


@frozen
class Step:
    """One launch of a program: the kernel and, for each of its parameters, the program name bound to it."""

    kernel: KernelSource
    arguments: tuple[str, ...]


@frozen
class BoundLaunch:
    """A step with its arguments' values and its launch shape, ready for a launcher."""

    kernel: KernelSource
    shape: LaunchShape
    arguments: tuple[object, ...]


def _no_derived_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    return {}


def _no_scratch(sizes: Mapping[str, int]) -> dict[str, int]:
    return {}


@frozen
class KernelProgram:
    """A family's launches: its operands and sizes (`params`) and the kernels it runs in order.

    `derived(sizes)` gives the sizes the program computes from the given
    ones (a launch shape or a scratch size may depend on them; steps may bind
    them); `scratch(sizes)` the bytes of each scratch operand, which the
    caller allocates and which needs no initial value.
    """

    family: str
    params: tuple[KernelParam, ...]
    steps: tuple[Step, ...]
    derived: Callable[[Mapping[str, int]], dict[str, int]] = field(default=_no_derived_sizes, eq=False, repr=False)
    scratch: Callable[[Mapping[str, int]], dict[str, int]] = field(default=_no_scratch, eq=False, repr=False)

    @property
    def kernels(self) -> tuple[KernelSource, ...]:
        """Each kernel the program launches, once, in first-launch order."""
        return tuple({s.kernel.name: s.kernel for s in self.steps}.values())

    @property
    def sizes(self) -> tuple[str, ...]:
        """The names of the sizes a caller gives (the scalar parameters)."""
        return tuple(p.name for p in self.params if p.role == "scalar")

    def all_sizes(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """The given sizes and the ones derived from them; a missing or non-positive size is a ValueError."""
        missing = [name for name in self.sizes if name not in sizes]
        if missing:
            raise ValueError(f"{self.family}: sizes {', '.join(missing)} not given")
        given = {name: int(sizes[name]) for name in self.sizes}
        for name, value in given.items():
            if value < 1:
                raise ValueError(f"{self.family}: size {name} is {value}; launches need sizes of at least 1")
        return given | self.derived(given)

    def scratch_bytes(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """The bytes of each scratch operand for these sizes."""
        return self.scratch(self.all_sizes(sizes))

    def launches(self, values: Mapping[str, object]) -> list[BoundLaunch]:
        """The launches in order, given a value for every parameter (device addresses and sizes) by name."""
        missing = [p.name for p in self.params if p.name not in values]
        if missing:
            raise ValueError(f"{self.family}: no value for {', '.join(missing)}")
        sizes = self.all_sizes(values)
        bound = {**values, **sizes}
        return [BoundLaunch(s.kernel, s.kernel.launch(sizes), tuple(bound[a] for a in s.arguments))
                for s in self.steps]


def single(kernel: KernelSource, derived: Callable[[Mapping[str, int]], dict[str, int]] = _no_derived_sizes,
           scratch: Callable[[Mapping[str, int]], dict[str, int]] = _no_scratch) -> KernelProgram:
    """The program of a family that is one kernel, its parameters the program's."""
    return KernelProgram(kernel.family, kernel.params, (Step(kernel, tuple(p.name for p in kernel.params)),),
                         derived, scratch)


# --- helpers the templates share -----------------------------------------------------------------------

def c_type(dtype: str) -> str:
    return C_TYPES[dtype]


def pointer_param(name: str, dtype: str, role: str, restrict: bool = True) -> KernelParam:
    """A pointer parameter; inputs are const; `restrict` unless the buffer may be another parameter's."""
    const = "const " if role == "input" else ""
    qualifier = " __restrict__" if restrict else ""
    return KernelParam(name, f"{const}{c_type(dtype)}*{qualifier}", role, dtype)


def size_param(name: str) -> KernelParam:
    return KernelParam(name, "int", "scalar", "i32")


def check_dtype(what: str, dtype: str, allowed: Sequence[str]) -> None:
    if dtype not in allowed:
        raise ValueError(f"{what}: dtype {dtype!r} is not one of {', '.join(allowed)}")


def itemsize(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def vector_width(count: int | None, dtypes: Sequence[str]) -> int:
    """Elements per access for rows of `count` elements: at most 16 bytes of the widest dtype, dividing `count`.

    A runtime length (None) gets 1: its rows may start anywhere.
    """
    if count is None:
        return 1
    widest = max(itemsize(d) for d in dtypes)
    width = 16 // widest
    while count % width:
        width //= 2
    return width


def float_literal(value: float) -> str:
    """`value` as a C float literal that rounds to the same f32 (`SX_INF`, `SX_NAN` for the specials)."""
    if math.isnan(value):
        return "SX_NAN"
    if math.isinf(value):
        return "SX_INF" if value > 0 else "(-SX_INF)"
    text = f"{value:.9g}"
    if not any(ch in text for ch in ".en"):
        text += ".0"
    return f"{text}f"


def signature(params: Sequence[KernelParam]) -> str:
    return ", ".join(f"{p.ctype} {p.name}" for p in params)


def kernel_head(threads: int, params: Sequence[KernelParam]) -> str:
    """The opening of a kernel of `threads` a block, its name left as `{NAME}` for `finish`.

    The launch bounds ask for one resident block per SM at least: without that, ptxas for sm_90
    aims at two blocks of 1024 threads (32 registers each) and spills a block-per-row kernel.
    """
    return f'extern "C" __global__ void __launch_bounds__({threads}, 1) {{NAME}}({signature(params)}) {{\n'


_NAME_CHARACTERS = {".": "p", "-": "m"}


def finish(stem: str, code_template: str) -> tuple[str, str]:
    """The kernel's name (`stem` made an identifier, and a hash of the code, so equal names mean equal code)
    and its code.

    `code_template` writes the name as `{NAME}`.
    """
    digest = hashlib.sha256(code_template.encode()).hexdigest()[:8]
    readable = re.sub(r"[^0-9A-Za-z_]", lambda m: _NAME_CHARACTERS.get(m.group(0), ""), stem)
    name = f"sx_{readable}_{digest}"
    return name, code_template.replace("{NAME}", name)

