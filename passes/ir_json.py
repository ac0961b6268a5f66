"""`ir-json{compact=false}`: the whole experiment as one JSON document, streamed to `unit.out`.

The document (`sexpgpu/schemas/ir.schema.json`) holds the manifest (tool
version, selection, the source files read with their sha256), the run
configuration, the parameters, loaders, optimizer groups (each naming its
update graphs), evaluations, diagnostics, and every graph with every op:
operands and results by value id, result shapes and dtypes, attributes and
location.

It is written op by op and never held whole: a full-size model's document
runs to hundreds of megabytes. Each op is one line of the pretty form (the
structure around the ops is indented); `compact=true` drops the newlines and
indentation. Non-finite floats, which JSON lacks, are written as the strings
"inf", "-inf" and "nan".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TextIO

from attrs import define

from ..diagnostics import Location, display_path, source_digest
from ..dialects.core import Operation, SymbolRef, TensorType
from ..dialects.printer import attribute_json
from ..version import __version__
from .manager import CompilationUnit, DumpPass, register_pass

FORMAT = "sexpgpu-ir"
FORMAT_VERSION = 1
#: Op lines gathered before one write to the stream.
FLUSH_LINES = 2048

#: Top-level document keys holding lists of exp ops' attributes, in document order.
EXP_LISTS = (("parameters", "exp.param"), ("loaders", "exp.loader"), ("evaluations", "exp.evaluation"),
             ("diagnostics", "exp.diagnostic"))


def _unknown_type(value: Any) -> Any:
    """The `default` hook of the fast encoder: attribute types JSON lacks become plain data."""
    if isinstance(value, (TensorType, SymbolRef)):
        return attribute_json(value)
    return str(value)


def source_files(unit: CompilationUnit) -> list[dict[str, str]]:
    """The files the experiment was read from, with the sha256 of their bytes.

    The unit's file, then every file an op's location (or the library frame
    it was reached through) names, in first-seen order: the requires and the
    prelude that made the graphs. Only files this compilation read are listed,
    hashed as they were read: a file a location merely names (textual IR may
    name any path) is never opened.
    """
    named: dict[str, None] = {unit.path: None} if unit.path else {}
    locs: dict[int, Location | None] = {}

    def visit(op: Operation) -> None:
        # Loops rather than Operation.walk: a generator per op costs more than the rest of this.
        for region in op.regions:
            for block in region.blocks:
                for inner in block.ops:
                    locs[id(inner.loc)] = inner.loc
                    if inner.regions:
                        visit(inner)

    locs[id(unit.module.loc)] = unit.module.loc
    visit(unit.module)
    for loc in locs.values():
        while loc is not None:
            named[loc.file] = None
            loc = loc.via
    out: dict[str, dict[str, str]] = {}
    for file in named:
        digest = source_digest(file)
        if digest is not None:
            out.setdefault(os.path.abspath(file), {"path": display_path(file), "sha256": digest})
    return list(out.values())


class _Writer:
    """Writes JSON pieces to a stream, pretty (indented) or compact."""

    def __init__(self, out: TextIO, compact: bool) -> None:
        self.out = out
        self.compact = compact
        comma, colon = self.separators
        # The C encoder itself, made once: JSONEncoder.encode would rebuild it on every call.
        self.fast = json.encoder.c_make_encoder(
            None, _unknown_type, json.encoder.encode_basestring, None, colon, comma, False, False, False
        )
        self._safe = json.JSONEncoder(separators=self.separators, ensure_ascii=False)
        #: Texts the graph encoders share, by cache name (see `_GraphEncoder`).
        self.caches: dict[str, dict[Any, str]] = {}

    @property
    def separators(self) -> tuple[str, str]:
        return (",", ":") if self.compact else (", ", ": ")

    def encode(self, value: Any) -> str:
        """One value on one line; the C encoder unless a non-finite float needs converting."""
        try:
            return "".join(self.fast(value, 0))
        except ValueError:
            return self._safe.encode(attribute_json(value))

    def newline(self, depth: int) -> str:
        return "" if self.compact else "\n" + "  " * depth

    def key(self, name: str) -> str:
        return json.dumps(name) + self.separators[1]

    def members(self, items: Iterator[tuple[str, Any]], depth: int) -> None:
        """`"key": value` members of an object whose braces the caller writes; values are encoded or callables."""
        first = True
        for name, value in items:
            self.out.write(("" if first else ",") + self.newline(depth) + self.key(name))
            first = False
            if callable(value):
                value(depth)
            else:
                self.out.write(self.encode(value))

    def array(self, lines: Iterator[str], depth: int) -> None:
        """An array of already encoded items, one per line, written in batches."""
        self.out.write("[")
        lead = self.newline(depth + 1)
        item_sep = "," + lead
        batch: list[str] = []
        wrote = False
        for line in lines:
            batch.append(line)
            if len(batch) >= FLUSH_LINES:
                self.out.write(("," if wrote else "") + lead + item_sep.join(batch))
                wrote, batch = True, []
        if batch:
            self.out.write(("," if wrote else "") + lead + item_sep.join(batch))
            wrote = True
        self.out.write((self.newline(depth) if wrote else "") + "]")


class _GraphEncoder:
    """Encodes one graph's ops, numbering its values 0, 1, ... in definition order.

    Values, types and locations are looked up by `id`: their own hashes are
    Python-level, and the objects live (unchanged) for the whole write.
    """

    def __init__(self, writer: _Writer, types: dict[int, str], locs: dict[int, str]) -> None:
        self.writer = writer
        self.ids: dict[int, str] = {}
        self.types = types
        self.locs = locs
        self.comma, self.colon = writer.separators
        # The caches below hold text that does not depend on the graph: the writer keeps them for all graphs.
        caches = writer.caches
        #: A file name as JSON, by the name a location holds.
        self.files: dict[str, str] = caches.setdefault("files", {})
        #: Type and location texts by value, behind the caches by `id` (objects with equal values abound).
        self.by_value: dict[tuple[Any, ...], str] = caches.setdefault("by_value", {})
        #: The text of an op line up to its operands, by op name.
        self.heads: dict[str, str] = caches.setdefault("heads", {})
        #: A lone result's text after its id, up to the attributes, by `id` of its type.
        self.result_types: dict[int, str] = caches.setdefault("result_types", {})

    def type_of(self, t: TensorType) -> str:
        text = self.types.get(id(t))
        if text is None:
            key = (t.shape, t.dtype)
            text = self.by_value.get(key)
            if text is None:
                c, k = self.comma, self.colon
                text = self.by_value[key] = f'{{"shape"{k}[{c.join(map(str, t.shape))}]{c}"dtype"{k}"{t.dtype}"}}'
            self.types[id(t)] = text
        return text

    def loc_of(self, loc: Location | None) -> str:
        if loc is None:
            return "null"
        text = self.locs.get(id(loc))
        if text is None:
            key = (loc.file, loc.line, loc.col)
            text = self.by_value.get(key)
            if text is None:
                file = self.files.get(loc.file)
                if file is None:
                    file = self.files[loc.file] = json.dumps(display_path(loc.file), ensure_ascii=False)
                c, k = self.comma, self.colon
                text = self.by_value[key] = f'{{"file"{k}{file}{c}"line"{k}{loc.line}{c}"col"{k}{loc.col}}}'
            self.locs[id(loc)] = text
        return text

    def op_lines(self, ops: Iterator[Operation]) -> Iterator[str]:
        """Each op's line, made from pieces cached by op name, type and location (the hot loop of `ir`)."""
        ids = self.ids
        c, k = self.comma, self.colon
        heads = self.heads
        types = self.result_types
        locs = self.locs
        encode = self.writer.encode
        fast = self.writer.fast
        mid = f"]{c}\"results\"{k}["
        tail_sep = f"]{c}\"attributes\"{k}"
        loc_sep = f"{c}\"loc\"{k}"
        result_head = f'{{"id"{k}'
        one_result = mid + result_head
        for op in ops:
            name = op.name
            head = heads.get(name)
            if head is None:
                head = heads[name] = f'{{"op"{k}{json.dumps(name)}{c}"operands"{k}['
            operands = op.operands
            if not operands:
                used = ""
            elif len(operands) == 1:
                used = ids[id(operands[0])]
            else:
                used = c.join([ids[id(v)] for v in operands])
            results = op.results
            if len(results) == 1:
                # The common case in one piece: `], "results": [{"id": N, "type": T}], "attributes": `.
                r = results[0]
                n = ids[id(r)] = str(len(ids))
                t = r.type
                tail = types.get(id(t))
                if tail is None:
                    tail = types[id(t)] = f"{c}\"type\"{k}{self.type_of(t)}}}{tail_sep}"
                made = f"{one_result}{n}{tail}"
            else:
                made_list = []
                for r in results:
                    n = ids[id(r)] = str(len(ids))
                    made_list.append(f"{result_head}{n}{c}\"type\"{k}{self.type_of(r.type)}}}")
                made = f"{mid}{c.join(made_list)}{tail_sep}"
            loc = op.loc
            loc_text = locs.get(id(loc))
            if loc_text is None:
                loc_text = self.loc_of(loc)
            attrs = op.attributes
            if not attrs:
                attrs_text = "{}"
            else:
                try:
                    attrs_text = "".join(fast(attrs, 0))
                except ValueError:  # a non-finite float
                    attrs_text = encode(attrs)
            yield f"{head}{used}{made}{attrs_text}{loc_sep}{loc_text}}}"


def write_ir(unit: CompilationUnit, out: TextIO, compact: bool = False) -> None:
    """Stream the unit's experiment document to `out` (see the module docstring)."""
    module = unit.require_module("ir-json")
    top = list(module.body.ops)
    by_name: dict[str, list[Operation]] = {}
    for op in top:
        by_name.setdefault(op.name, []).append(op)
    funcs = by_name.get("graph.func", [])
    selection = by_name.get("exp.selection", [])
    runs = by_name.get("exp.run", [])
    w = _Writer(out, compact)
    types: dict[int, str] = {}
    locs: dict[int, str] = {}

    def exp_list(ops: list[Operation]) -> Callable[[int], None]:
        return lambda depth: w.array((w.encode(op.attributes) for op in ops), depth)

    def groups(depth: int) -> None:
        updates: dict[str, list[str]] = {}
        for func in funcs:
            if func.attributes.get("kind") == "update":
                updates.setdefault(func.attributes.get("group", ""), []).append(func.attributes["sym_name"])
        lines = (
            w.encode({**op.attributes, "update_graphs": updates.get(op.attributes["name"], [])})
            for op in by_name.get("exp.group", [])
        )
        w.array(lines, depth)

    def graph(func: Operation) -> Any:
        def body(depth: int) -> None:
            w.out.write("{")
            encoder = _GraphEncoder(w, types, locs)
            w.members(
                iter(
                    [
                        ("name", func.attributes["sym_name"]),
                        ("kind", func.attributes.get("kind")),
                        ("attributes", func.attributes),
                        ("loc", json.loads(encoder.loc_of(func.loc))),
                        ("ops", lambda d: w.array(encoder.op_lines(func.body.ops), d)),
                    ]
                ),
                depth + 1,
            )
            w.out.write(w.newline(depth) + "}")

        return body

    def graphs(depth: int) -> None:
        w.out.write("[")
        for i, func in enumerate(funcs):
            w.out.write(("," if i else "") + w.newline(depth + 1))
            graph(func)(depth + 1)
        w.out.write((w.newline(depth) if funcs else "") + "]")

    manifest = {
        "tool": f"sexpgpu {__version__}",
        "file": display_path(unit.path) if unit.path else None,
        "files": source_files(unit),
        "selection": selection[0].attributes if selection else {"variant": unit.variant, "knobs": {}},
    }
    def manifest_object(depth: int) -> None:
        out.write("{")
        w.members(iter(manifest.items()), depth + 1)
        out.write(w.newline(depth) + "}")

    members: list[tuple[str, Any]] = [
        ("format", FORMAT),
        ("version", FORMAT_VERSION),
        ("manifest", manifest_object),
        ("run", runs[0].attributes if runs else None),
    ]
    members += [(key, exp_list(by_name.get(name, []))) for key, name in EXP_LISTS]
    members += [("groups", groups), ("graphs", graphs)]
    out.write("{")
    w.members(iter(members), 1)
    out.write(w.newline(0) + "}\n")


@register_pass
@define
class IrJsonPass(DumpPass):
    """Streams the unit's experiment as the JSON document of the module docstring.

    Guarantees: the unit is unchanged; the output is one JSON document
    (`compact`: on one line).
    """

    name: ClassVar[str] = "ir-json"
    summary: ClassVar[str] = "dump the whole experiment as a JSON document, streamed (compact=true: one line)"

    compact: bool = False

    def dump(self, unit: CompilationUnit) -> None:
        write_ir(unit, unit.out, self.compact)
