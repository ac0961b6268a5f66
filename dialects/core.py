"""The IR core: types, values, operations, blocks, regions, and the op registry.

Every value is defined once (by an op result or a block argument) and keeps
the set of its uses, so replacing a value is proportional to its uses, never
to the size of the module. Blocks keep their ops in a doubly linked list, so
inserting and erasing are O(1).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from attrs import define, field, frozen

from ..diagnostics import Location, Note, SxError

DTYPES = ("f32", "bf16", "f16", "i32", "i64", "i1")
FLOAT_DTYPES = ("f32", "bf16", "f16")
INT_DTYPES = ("i32", "i64")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "i1": 1}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building a large IR.

    Every op, value and use made while building stays alive, so collections
    find nothing to free but re-traverse the ever larger graph: building
    50,000 ops took 5x as long as building 25,000 with it running.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tune_gc_for_large_ir() -> None:
    """Make Python's cyclic collector run rarely, as a compiler process wants.

    An IR is a large, long-lived graph of small objects; with the default
    thresholds every few hundred allocations trigger a collection, and the
    full ones re-traverse the whole graph, so passes slow down as the module
    grows (cse+dce on 50,000 ops: 4x the time of 25,000). mypy makes the same
    trade. The command-line tools call this once at start.
    """
    gc.set_threshold(100_000, 50, 1_000)


@frozen
class TensorType:
    """A statically shaped tensor type, printed `tensor<4x64xf32>` (`tensor<f32>` for a scalar)."""

    shape: tuple[int, ...] = field(converter=tuple)
    dtype: str

    def __str__(self) -> str:
        dims = "".join(f"{d}x" for d in self.shape)
        return f"tensor<{dims}{self.dtype}>"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(self.shape, dtype)

    def with_shape(self, shape: Sequence[int]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)


@frozen
class SymbolRef:
    """A reference to a symbol (`@train`), as an attribute value."""

    name: str

    def __str__(self) -> str:
        return "@" + quote_symbol(self.name)


def quote_symbol(name: str) -> str:
    if name and all(c.isalnum() or c in "_.$-" for c in name) and not name[0].isdigit():
        return name
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


@define(eq=False, slots=True)
class Use:
    """One operand slot of an op that reads a value."""

    op: Operation
    index: int


@define(eq=False, slots=True)
class Value:
    """An SSA value: the result of an op or an argument of a block."""

    type: TensorType
    owner: Operation | Block | None = None
    index: int = 0
    uses: dict[Use, None] = field(factory=dict, repr=False)
    name_hint: str | None = None

    @property
    def op(self) -> Operation | None:
        return self.owner if isinstance(self.owner, Operation) else None

    def replace_all_uses_with(self, other: Value) -> None:
        """Make every reader of this value read `other`: O(number of uses)."""
        if other is self:
            return
        for use in self.uses:
            use.op.operands[use.index] = other
            other.uses[use] = None
        self.uses.clear()

    @property
    def has_uses(self) -> bool:
        return bool(self.uses)

    def users(self) -> Iterator[Operation]:
        seen: set[int] = set()
        for use in self.uses:
            if id(use.op) not in seen:
                seen.add(id(use.op))
                yield use.op

    def __hash__(self) -> int:
        return id(self)


class OpDef:
    """The definition of an op kind: its name, family and verifier.

    Subclasses set `name` and `family`, and may override `infer` (compute the
    result types from the operands and attributes, raising `VerifyError`) and
    `verify` (check an op already built).
    """

    name: ClassVar[str]
    family: ClassVar[str]
    #: Number of operands, or None when variadic.
    num_operands: ClassVar[int | None] = None
    num_results: ClassVar[int | None] = 1
    num_regions: ClassVar[int] = 0
    #: Attributes every op of this kind must have.
    required_attrs: ClassVar[tuple[str, ...]] = ()
    #: Whether an op with unused results may be erased and equal ops merged.
    pure: ClassVar[bool] = True
    is_terminator: ClassVar[bool] = False

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType] | None:
        """Result types for these operand types and attributes; None when the results are free."""
        return [] if cls.num_results == 0 else None

    @classmethod
    def verify(cls, op: Operation) -> None:
        if cls.num_operands is not None and len(op.operands) != cls.num_operands:
            raise VerifyError(f"'{cls.name}' expects {cls.num_operands} operands, got {len(op.operands)}", op)
        if cls.num_results is not None and len(op.results) != cls.num_results:
            raise VerifyError(f"'{cls.name}' expects {cls.num_results} results, got {len(op.results)}", op)
        if len(op.regions) != cls.num_regions:
            raise VerifyError(f"'{cls.name}' expects {cls.num_regions} regions, got {len(op.regions)}", op)
        for attr in cls.required_attrs:
            if attr not in op.attributes:
                raise VerifyError(f"'{cls.name}' requires attribute '{attr}'", op)
        expected = cls.infer([v.type for v in op.operands], op.attributes)
        if expected is not None:
            actual = [r.type for r in op.results]
            if actual != list(expected):
                shown = ", ".join(map(str, expected))
                raise VerifyError(
                    f"'{cls.name}' result type {', '.join(map(str, actual))} does not match the inferred {shown}", op
                )


class VerifyError(SxError):
    """An op that breaks its definition's rules.

    The error is located at the op's own `loc`; an op parsed from textual IR
    without a location (`loc(unknown)`) is located at its line in the IR file,
    and one with both gets a note pointing at that line.
    """

    def __init__(self, message: str, op: Operation | None = None) -> None:
        super().__init__(message)
        self.op: Operation | None = None
        if op is not None:
            self.attach(op)

    def attach(self, op: Operation) -> None:
        """Locate this error at `op` (shape errors raised by `infer` know no op)."""
        self.op = op
        self.loc = op.diagnostic_loc
        if op.loc is not None and op.text_loc is not None:
            self.notes.append(Note(op.text_loc, f"'{op.name}' is defined here in the IR"))


class Registry:
    """All op definitions known, by name."""

    def __init__(self) -> None:
        self.ops: dict[str, type[OpDef]] = {}

    def register(self, opdef: type[OpDef]) -> type[OpDef]:
        if opdef.name in self.ops:
            raise ValueError(f"op {opdef.name} registered twice")
        self.ops[opdef.name] = opdef
        return opdef

    def lookup(self, name: str) -> type[OpDef] | None:
        return self.ops.get(name)

    def family(self, name: str) -> str:
        opdef = self.ops.get(name)
        return opdef.family if opdef else "unknown"


REGISTRY = Registry()


def register_op(opdef: type[OpDef]) -> type[OpDef]:
    """Class decorator adding an op definition to the registry."""
    return REGISTRY.register(opdef)


@define(eq=False, slots=True)
class Operation:
    """One op: operands, results, attributes, regions and a location."""

    name: str
    operands: list[Value] = field(factory=list)
    results: list[Value] = field(factory=list)
    attributes: dict[str, Any] = field(factory=dict)
    regions: list[Region] = field(factory=list)
    loc: Location | None = None
    parent: Block | None = field(default=None, repr=False)
    _prev: Operation | None = field(default=None, repr=False)
    _next: Operation | None = field(default=None, repr=False)
    #: Where the op was written in a textual IR file (set by the parser). Kept
    #: apart from `loc`, which is the source position the op stands for and
    #: round-trips through the text as written.
    text_loc: Location | None = field(default=None, repr=False)
    #: The `Use` of each operand slot, so unlinking an operand is O(1) even for
    #: a value with many readers.
    operand_uses: list[Use] = field(factory=list, repr=False)

    @property
    def diagnostic_loc(self) -> Location | None:
        """Where an error about this op points: its `loc`, else its line in the textual IR it was read from."""
        return self.loc if self.loc is not None else self.text_loc

    @classmethod
    def create(
        cls,
        name: str,
        operands: Sequence[Value] = (),
        result_types: Sequence[TensorType] = (),
        attributes: dict[str, Any] | None = None,
        regions: Sequence[Region] = (),
        loc: Location | None = None,
    ) -> Operation:
        op = cls(name=name, attributes=dict(attributes or {}), loc=loc)
        for i, v in enumerate(operands):
            use = Use(op, i)
            op.operands.append(v)
            op.operand_uses.append(use)
            v.uses[use] = None
        op.results = [Value(t, op, i) for i, t in enumerate(result_types)]
        for r in regions:
            op.add_region(r)
        return op

    def __hash__(self) -> int:
        return id(self)

    @property
    def opdef(self) -> type[OpDef] | None:
        return REGISTRY.ops.get(self.name)

    @property
    def family(self) -> str:
        return REGISTRY.family(self.name)

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results")
        return self.results[0]

    def add_region(self, region: Region) -> None:
        region.parent = self
        self.regions.append(region)

    def clone(self, value_mapper: dict[Value, Value] | None = None) -> Operation:
        """A detached deep copy of this op, as MLIR's `Operation::clone(IRMapping&)` and xDSL's
        `Operation.clone(value_mapper=...)`.

        Its regions' blocks and ops are copied too. An operand found in
        `value_mapper` is replaced by what it maps to, one absent (defined
        outside the op and not mapped) is kept. Every result and block argument
        of the original is added to `value_mapper`, mapping to its copy, so a
        caller cloning ops one after another finds each copy's operands among
        the copies made before. Locations and name hints carry over; attribute
        values are copied wherever they are mutable (lists, dicts, sets), so
        changing an attribute of the copy never changes the original.
        """
        values = {} if value_mapper is None else value_mapper
        copy = Operation.create(self.name, [values.get(v, v) for v in self.operands],
                                [r.type for r in self.results], _copy_attributes(self.attributes), loc=self.loc)
        copy.text_loc = self.text_loc
        for old, new in zip(self.results, copy.results):
            new.name_hint = old.name_hint
            values[old] = new
        for region in self.regions:
            region_copy = Region()
            for block in region.blocks:
                block_copy = region_copy.add_block(Block())
                for arg in block.args:
                    values[arg] = block_copy.add_arg(arg.type)
                    values[arg].name_hint = arg.name_hint
                for inner in block.ops:
                    block_copy.append(inner.clone(values))
            copy.add_region(region_copy)
        return copy

    def set_operand(self, index: int, value: Value) -> None:
        use = self.operand_uses[index]
        del self.operands[index].uses[use]
        self.operands[index] = value
        value.uses[use] = None

    def drop_operands(self) -> None:
        for use, v in zip(self.operand_uses, self.operands):
            del v.uses[use]
        self.operands = []
        self.operand_uses = []

    def erase(self) -> None:
        """Remove this op from its block; its results must be unused."""
        for r in self.results:
            if r.uses:
                raise ValueError(f"erasing {self.name} whose result still has uses")
        for region in self.regions:
            for block in region.blocks:
                for op in reversed(list(block.ops)):
                    op.drop_operands()
        self.drop_operands()
        if self.parent is not None:
            self.parent.detach(self)

    def walk(self) -> Iterator[Operation]:
        """This op and every op nested in it, in pre-order."""
        yield self
        for region in self.regions:
            for block in region.blocks:
                for op in block.ops:
                    if op.regions:
                        yield from op.walk()
                    else:  # most ops hold no regions: no generator per leaf
                        yield op

    @property
    def next_op(self) -> Operation | None:
        return self._next

    @property
    def prev_op(self) -> Operation | None:
        return self._prev

    @property
    def body(self) -> Block:
        """The single block of the single region (graph.func, exp.module)."""
        return self.regions[0].blocks[0]

    def verify(self) -> None:
        """Verify this op and everything nested in it; raises the first VerifyError."""
        for op in self.walk():
            op.verify_one()

    def verify_one(self) -> None:
        """Verify this op alone (not what its regions hold), locating any error at it."""
        opdef = REGISTRY.ops.get(self.name)
        if opdef is None:
            raise VerifyError(f"unknown op '{self.name}'", self)
        try:
            opdef.verify(self)
        except VerifyError as err:
            if err.op is None:
                err.attach(self)
            raise
        except (TypeError, ValueError, IndexError, KeyError) as err:
            # Hand-written IR can hold attributes of the wrong kind (`axes = 1`,
            # `axis = "x"`), which the shape rules do not expect: a user error.
            raise VerifyError(f"'{self.name}' has malformed attributes ({type(err).__name__}: {err})", self) from None


def _copy_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {name: _copy_attribute(value) for name, value in attributes.items()}


def _copy_attribute(value: Any) -> Any:
    """`value` with every list, dict and set in it copied; the rest (numbers, strings, types, symbol
    references: immutable) shared."""
    if isinstance(value, list):
        return [_copy_attribute(item) if isinstance(item, (list, dict, set, tuple)) else item for item in value]
    if isinstance(value, dict):
        return {key: _copy_attribute(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_copy_attribute(item) for item in value) if any(
            isinstance(item, (list, dict, set, tuple)) for item in value) else value
    if isinstance(value, set):
        return set(value)
    return value


@define(eq=False, slots=True)
class Block:
    """A list of ops with arguments. Ops form a doubly linked list."""

    args: list[Value] = field(factory=list)
    parent: Region | None = field(default=None, repr=False)
    _first: Operation | None = field(default=None, repr=False)
    _last: Operation | None = field(default=None, repr=False)
    _count: int = 0

    def __hash__(self) -> int:
        return id(self)

    def add_arg(self, type_: TensorType) -> Value:
        v = Value(type_, self, len(self.args))
        self.args.append(v)
        return v

    @property
    def ops(self) -> Iterator[Operation]:
        op = self._first
        while op is not None:
            nxt = op._next
            yield op
            op = nxt

    def reversed_ops(self) -> Iterator[Operation]:
        op = self._last
        while op is not None:
            prv = op._prev
            yield op
            op = prv

    def __len__(self) -> int:
        return self._count

    @property
    def first_op(self) -> Operation | None:
        return self._first

    @property
    def last_op(self) -> Operation | None:
        return self._last

    def append(self, op: Operation) -> Operation:
        self._link(op, self._last, None)
        return op

    def insert_before(self, op: Operation, anchor: Operation) -> Operation:
        self._link(op, anchor._prev, anchor)
        return op

    def insert_after(self, op: Operation, anchor: Operation) -> Operation:
        self._link(op, anchor, anchor._next)
        return op

    def _link(self, op: Operation, prev: Operation | None, nxt: Operation | None) -> None:
        if op.parent is not None:
            raise ValueError(f"{op.name} is already in a block")
        op.parent = self
        op._prev, op._next = prev, nxt
        if prev is None:
            self._first = op
        else:
            prev._next = op
        if nxt is None:
            self._last = op
        else:
            nxt._prev = op
        self._count += 1

    def detach(self, op: Operation) -> None:
        if op._prev is None:
            self._first = op._next
        else:
            op._prev._next = op._next
        if op._next is None:
            self._last = op._prev
        else:
            op._next._prev = op._prev
        op._prev = op._next = None
        op.parent = None
        self._count -= 1


@define(eq=False, slots=True)
class Region:
    blocks: list[Block] = field(factory=list)
    parent: Operation | None = field(default=None, repr=False)

    def __hash__(self) -> int:
        return id(self)

    @classmethod
    def with_block(cls) -> Region:
        region = cls()
        region.add_block(Block())
        return region

    def add_block(self, block: Block) -> Block:
        block.parent = self
        self.blocks.append(block)
        return block


@define(eq=False)
class Builder:
    """Creates ops at an insertion point, inferring result types from the registry.

    A builder with `loc` set stamps that location on every op it creates
    unless the call gives its own.
    """

    block: Block
    anchor: Operation | None = None
    loc: Location | None = None
    #: Called with each created op (the tracer uses it to stamp notes).
    on_create: Callable[[Operation], None] | None = None

    def create(
        self,
        name: str,
        operands: Sequence[Value] = (),
        attributes: dict[str, Any] | None = None,
        result_types: Sequence[TensorType] | None = None,
        loc: Location | None = None,
        regions: Iterable[Region] = (),
    ) -> Operation:
        attributes = attributes or {}  # copied by Operation.create; no rule mutates what it reads
        opdef = REGISTRY.ops.get(name)
        if opdef is None:
            raise ValueError(f"unknown op {name}")
        if result_types is None:
            try:
                inferred = opdef.infer([v.type for v in operands], attributes)
            except VerifyError as err:
                if err.loc is None:
                    err.loc = loc or self.loc
                raise
            if inferred is None:
                raise ValueError(f"{name} needs explicit result types")
            result_types = inferred
        op = self.insert(Operation.create(name, operands, result_types, attributes, list(regions), loc or self.loc))
        if self.on_create is not None:
            self.on_create(op)
        return op

    def insert(self, op: Operation) -> Operation:
        """Insert a detached op (a clone) at the insertion point, as it is."""
        if self.anchor is None:
            self.block.append(op)
        else:
            self.block.insert_before(op, self.anchor)
        return op

    def value(self, name: str, *operands: Value, loc: Location | None = None, **attributes: Any) -> Value:
        """Create a single-result op and return its result."""
        return self.create(name, operands, attributes, loc=loc).result


def module_holding(ops: Sequence[Operation]) -> Operation:
    """A new `builtin.module` holding copies of `ops` (top-level ops of modules, in order, sharing one value
    map): a lowering rewrites what it lowers, and the module the copies came from stays as it was."""
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    values: dict[Value, Value] = {}
    for op in ops:
        module.body.append(op.clone(values))
    return module


def enclosing_module(op: Operation) -> Operation | None:
    """The `builtin.module` whose body holds `op`, if any."""
    block = op.parent
    region = block.parent if block is not None else None
    owner = region.parent if region is not None else None
    return owner if owner is not None and owner.name == "builtin.module" else None
