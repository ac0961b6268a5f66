"""Liveness of values over a block's op order, and buffer plans built on it.

The block order is the schedule: op i runs at point i. `Liveness` says, for
every value of a block, where it is defined and last read; `StorageLiveness`
adds, for its storage, which value owns it (a view's storage is its
source's, so a view keeps its source alive) and when that storage is read
for the last time. Values the block returns or emits escape it; inputs and
constants have storage that outlives it.

Two uses: `peak_live_bytes` (the bound `plan-memory` reports, every value in
a buffer of its own) and `ArenaPlan` (buffers shared by values whose storage
lifetimes do not overlap, with offsets in one arena: the numpy interpreter
keeps one array per buffer, a GPU backend carves them out of one allocation).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from attrs import frozen

from .core import Block, Operation, Value
from .traits import Trait, ops_with

#: Ops whose result is a view of their first operand's storage.
VIEW_OPS = ops_with(Trait.VIEW)
#: Ops whose result's storage is not the block's to plan: inputs (the caller's) and constants (made once).
FIXED_OPS = ops_with(Trait.INPUT) | ops_with(Trait.CONSTANT_LIKE)


def lets_escape(op: Operation) -> bool:
    """Whether what `op` reads escapes the block: it is the terminator (the block's outputs) or an emit."""
    opdef = op.opdef
    return op.family == "emit" or (opdef is not None and opdef.is_terminator)


class Liveness:
    """Definition and last-read points of every value of `block`.

    A block argument is defined at point 0; a value nobody reads is last read
    at its definition; a value the terminator reads (the block's outputs) at
    the terminator, i.e. to the end.
    """

    def __init__(self, block: Block) -> None:
        self.ops: list[Operation] = list(block.ops)
        self.defined: dict[Value, int] = {}
        self.last_use: dict[Value, int] = {}
        defined, last_use = self.defined, self.last_use
        for arg in block.args:
            defined[arg] = last_use[arg] = 0
        for point, op in enumerate(self.ops):
            for v in op.operands:
                last_use[v] = point
            for r in op.results:
                defined[r] = last_use[r] = point

    def peak_live_bytes(self, values: Iterable[Value]) -> int:
        """The most bytes of `values` live at one point, each value live from its definition to
        its last read (an op's operands and results together), none sharing storage."""
        delta = [0] * (len(self.ops) + 1)
        defined, last_use = self.defined, self.last_use
        for v in values:
            nbytes = v.type.nbytes
            delta[defined[v]] += nbytes
            delta[last_use[v] + 1] -= nbytes
        peak = live = 0
        for change in delta:
            live += change
            if live > peak:
                peak = live
        return peak


class StorageLiveness(Liveness):
    """`Liveness`, and for storage: which value owns each value's storage (itself, or for a view
    its source's owner, so a view keeps its source alive), the last read of each storage through
    any view of it, the storage that escapes the block and the storage that outlives it."""

    def __init__(self, block: Block, views: frozenset[str] = VIEW_OPS) -> None:
        super().__init__(block)
        #: The value owning each value's storage: itself, or for a view its source's root.
        self.root: dict[Value, Value] = {arg: arg for arg in block.args}
        #: Last point at which each root's storage is read (through any view of it).
        self.storage_end: dict[Value, int] = {}
        #: Roots whose storage escapes the block: read by its terminator or an emit.
        self.escaping: set[Value] = set()
        #: Values whose storage outlives the block (inputs, constants).
        self.fixed: set[Value] = set()
        root = self.root
        for op in self.ops:
            results = op.results
            if results:
                source = op.operands[0] if op.name in views else None
                for r in results:
                    root[r] = r if source is None else root.get(source, source)
                if op.name in FIXED_OPS:
                    self.fixed.update(results)
            elif lets_escape(op):  # the terminator and emits have no results
                self.escaping.update(root.get(v, v) for v in op.operands)
        storage_end = self.storage_end
        for v, end in self.last_use.items():
            owner = root.get(v, v)
            if storage_end.get(owner, -1) < end:
                storage_end[owner] = end

    def is_view(self, value: Value) -> bool:
        return self.root[value] is not value


@frozen
class Buffer:
    """A range of an arena: `nbytes` (rounded up to the alignment) from `offset`."""

    #: Which buffer: 0, 1, ... in the order the plan first used them.
    index: int
    offset: int
    nbytes: int
    #: What a value must have to reuse this buffer when reuse is exact (e.g. shape and dtype).
    key: Hashable


class ArenaPlan:
    """Buffers for values, assigned in op order, reusing storage that has been read for the last time.

    `assign` is called for the values wanting a buffer, in the order of the ops
    defining them. A buffer is free again after the last read of its value's
    storage (`StorageLiveness.storage_end`). An op marked `in_place` (an elementwise
    op, which may write over what it reads element by element) may get the
    buffer of an operand it reads for the last time; others (a matmul, a
    reduction) never overwrite what they read. Values that escape the block
    get no buffer.

    `exact`: a freed buffer is reused only by a value of the same key (the
    numpy interpreter keeps one array per buffer, of one shape and dtype), the
    most recently freed first; otherwise by any value that fits in a free
    range, the smallest such (lowest offset on ties), split as needed, freed
    ranges merging with their neighbours (a byte arena). Offsets and sizes are
    multiples of `alignment`. `size` is the arena's bytes: the peak of the plan.
    """

    def __init__(self, liveness: StorageLiveness, alignment: int = 1, exact: bool = True) -> None:
        self.liveness = liveness
        self.alignment = alignment
        self.exact = exact
        self.size = 0
        self.buffers: dict[Value, Buffer] = {}
        self._count = 0
        #: Storage end -> buffers freed after it, in assignment order.
        self._held: dict[int, list[Buffer]] = {}
        #: exact: key -> freed buffers; otherwise free (offset, nbytes) ranges sorted by offset.
        self._pools: dict[Hashable, list[Buffer]] = {}
        self._ranges: list[tuple[int, int]] = []

    def assign(self, value: Value, in_place: bool, key: Hashable = None, nbytes: int | None = None) -> Buffer | None:
        """The buffer of `value` (None when it escapes). `key` and `nbytes` default to the value's
        type and its bytes; a caller storing it otherwise (another dtype, a permuted shape) says so."""
        position = self.liveness.defined[value]
        if in_place:
            self._release(position)
        buffer = None
        if self.liveness.root[value] not in self.liveness.escaping:
            key = value.type if key is None else key
            size = -(-(value.type.nbytes if nbytes is None else nbytes) // self.alignment) * self.alignment
            buffer = self._reuse(key, size) or self._grow(key, size)
            self.buffers[value] = buffer
            self._held.setdefault(self.liveness.storage_end[value], []).append(buffer)
        if not in_place:
            self._release(position)
        return buffer

    def assign_op(self, values: Sequence[Value], over: Mapping[Value, Value] | None = None) -> list[Buffer | None]:
        """The buffers of all the results of one op (a kernel writing several outputs): none shares
        storage with another or with a value the op reads, except that a result `over` maps to an
        operand's root takes exactly that root's buffer when its storage ends at this op (an
        elementwise kernel writing each element over the one it has just read). Storage that ended
        before the op is free for its results; storage that ends at it only after."""
        if not values:
            return []
        position = self.liveness.defined[values[0]]
        self._release(position - 1)
        buffers: list[Buffer | None] = []
        for value in values:
            buffer = None
            if self.liveness.root[value] not in self.liveness.escaping:
                source = (over or {}).get(value)
                buffer = self._take(source, position) if source is not None else None
                if buffer is None:
                    size = -(-value.type.nbytes // self.alignment) * self.alignment
                    buffer = self._reuse(value.type, size) or self._grow(value.type, size)
                self.buffers[value] = buffer
                self._held.setdefault(self.liveness.storage_end[value], []).append(buffer)
            buffers.append(buffer)
        self._release(position)
        return buffers

    def _take(self, source: Value, position: int) -> Buffer | None:
        """`source`'s buffer, when its storage is read for the last time at `position` (it is then
        still held, to be freed after the op)."""
        buffer = self.buffers.get(source)
        held = self._held.get(position, [])
        if buffer is None or self.liveness.storage_end.get(source) != position or buffer not in held:
            return None
        held.remove(buffer)
        return buffer

    def _reuse(self, key: Hashable, size: int) -> Buffer | None:
        if self.exact:
            pool = self._pools.get(key)
            return pool.pop() if pool else None
        fits = [(n, offset) for offset, n in self._ranges if n >= size]
        if not fits:
            return None
        n, offset = min(fits)
        self._ranges.remove((offset, n))
        if n > size:
            self._ranges.append((offset + size, n - size))
            self._ranges.sort()
        return self._new(offset, size, key)

    def _grow(self, key: Hashable, size: int) -> Buffer:
        offset = self.size
        if not self.exact and self._ranges and sum(self._ranges[-1]) == self.size:
            offset, _ = self._ranges.pop()  # the free range at the top grows into the new buffer
        self.size = max(self.size, offset + size)
        return self._new(offset, size, key)

    def _new(self, offset: int, size: int, key: Hashable) -> Buffer:
        buffer = Buffer(self._count, offset, size, key)
        self._count += 1
        return buffer

    def _release(self, position: int) -> None:
        for ended in [p for p in self._held if p <= position]:
            for buffer in self._held.pop(ended):
                if self.exact:
                    self._pools.setdefault(buffer.key, []).append(buffer)
                else:
                    self._free_range(buffer.offset, buffer.nbytes)

    def _free_range(self, offset: int, nbytes: int) -> None:
        merged = []
        for start, n in self._ranges:
            if start + n == offset:
                offset, nbytes = start, n + nbytes
            elif offset + nbytes == start:
                nbytes += n
            else:
                merged.append((start, n))
        merged.append((offset, nbytes))
        merged.sort()
        self._ranges = merged
