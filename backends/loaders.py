"""Data loaders: what an `exp.loader` op reads when a run starts.

A loader draws batches of records from a source:

- token sources (`token-file`, `text-file`, a one-dimensional `npy-file`,
  `synthetic-tokens`) are one stream of token ids; a record is a window of the
  field's length. Shuffled, a batch is random windows drawn from a generator
  keyed by (seed, position), so a batch depends only on where the loader is,
  never on what came before; otherwise windows are consecutive and do not
  overlap, wrapping around at the end of the stream.
- record sources (an `npy-file` holding `[N, *record]`, or an `.npz` holding
  one such array per field) yield whole records; shuffled, each pass is a
  permutation keyed by (seed, epoch).

The position (records drawn so far) is all the state a loader has, so a
checkpoint records it and a resumed run draws exactly the batches the
uninterrupted run would have. Every problem with the data (a missing, empty or
too short file, a token id the model cannot take) is an `SxError` at the
`defloader` form naming the loader and the file, raised when the loader opens,
before the first step.
"""

from __future__ import annotations

import stat
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics import Location, SxError
from ..dialects.exp import TOKEN_FILE_FORMATS
from ..dialects.graph_semantics import numpy_dtypes
from ..dialects.traits import Trait, ops_with
from .token_files import DTYPE_NAMES, TokenFileError, open_tokens, read_layout

#: Field dtypes of the language → numpy dtypes: the dialect's, and `bool` for `i1`.
FIELD_DTYPES: dict[str, Any] = {**numpy_dtypes(), "bool": np.bool_}

#: Tokens scanned at once when checking ids against the vocabulary (bounds memory on big files).
_SCAN_CHUNK = 1 << 24

#: numpy dtype kinds a field's numbers can come from: bool, signed and unsigned ints, floats.
_NUMERIC_KINDS = frozenset("biuf")
#: The other kinds, as messages name them.
_DTYPE_KINDS = {"U": "text", "S": "bytes", "O": "Python objects", "V": "structured records", "c": "complex numbers",
                "M": "dates", "m": "time spans"}

#: What `stat` calls the files that are not regular files, as messages name them.
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip

#: The most a synthetic source generates (its generator is a Python loop: larger streams belong in a file).
SYNTHETIC_MAX_VOCAB = 1 << 20
SYNTHETIC_MAX_COUNT = 1 << 24


class Field:
    """One field of a loader's records: name, record shape, dtype."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype

    @property
    def numpy_dtype(self) -> Any:
        return FIELD_DTYPES[self.dtype]


class Loader:
    """Batches of records from one source; `position` (records drawn) is its whole state."""

    def __init__(
        self,
        name: str,
        source: dict[str, Any],
        fields: list[Field],
        batch: int,
        shuffle: bool,
        seed: int,
        loc: Location | None,
    ) -> None:
        self.name = name
        self.source = source
        self.fields = fields
        self.batch = batch
        self.shuffle = shuffle
        self.seed = seed
        self.loc = loc
        self.position = 0
        #: What the data came from, as messages name it (a path or the synthetic source).
        self.origin = ""
        #: The token stream of a token source (a memory map for files), else None.
        self.tokens: np.ndarray | None = None
        #: Field name → `[N, *record]` array of a record source, else empty.
        self.records: dict[str, np.ndarray] = {}
        self._permutation: tuple[int, np.ndarray] | None = None
        self._open()

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def from_op(cls, op: Any) -> Loader:
        """The loader an `exp.loader` op describes (its attributes as `dialects/exp.py` documents)."""
        attrs = op.attributes
        fields = [Field(f["name"], tuple(int(d) for d in f["shape"]), str(f["dtype"])) for f in attrs["fields"]]
        seed = attrs.get("seed")
        return cls(
            name=str(attrs["name"]),
            source=dict(attrs["source"]),
            fields=fields,
            batch=int(attrs["batch"]),
            shuffle=bool(attrs.get("shuffle", False)),
            seed=int(seed) if isinstance(seed, int) else 0,
            loc=op.loc,
        )

    def error(self, message: str) -> SxError:
        return SxError(f"loader {self.name}: {message}", self.loc)

    def _resolve(self, path: str) -> Path:
        """Paths are relative to the file that wrote the `defloader`."""
        candidate = Path(path)
        if candidate.is_absolute() or self.loc is None or self.loc.file.startswith("<"):
            return candidate
        return Path(self.loc.file).resolve().parent / candidate

    def _open_file(self, key: str = "path") -> Path:
        raw = self.source.get(key)
        if not isinstance(raw, str):
            raise self.error(f"source {self.source.get('kind')} needs a file path")
        path = self._resolve(raw)
        self.origin = raw
        try:
            info = path.stat()
        except FileNotFoundError:
            raise self.error(f"cannot read {raw}: no such file ({path})") from None
        except OSError as err:
            raise self.error(f"cannot read {raw}: {err.strerror or err} ({path})") from None
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
            raise self.error(f"cannot read {raw}: it is {kind}, not a file ({path})")
        if info.st_size == 0:
            raise self.error(f"{raw} is empty")
        return path

    def _open(self) -> None:
        kind = self.source.get("kind")
        if kind == "token-file":
            self._open_token_file(self._open_file())
        elif kind == "text-file":
            self.tokens = np.memmap(self._open_file(), dtype=np.uint8, mode="r")
        elif kind == "npy-file":
            self._open_npy(self._open_file())
        elif kind == "synthetic-tokens":
            self.tokens = self._synthesize()
        else:
            raise self.error(f"unknown source kind {kind!r}")
        if self.tokens is not None:
            self._check_token_fields()
        self._check_length()

    def _open_token_file(self, path: Path) -> None:
        """A nanoGPT stream or an llm.c file (token_files.py), memory-mapped: opening reads its header only."""
        dtype = self.source.get("dtype")
        if dtype is not None and dtype not in DTYPE_NAMES:
            raise self.error(f"token-file :dtype must be u16 or u32, not {dtype}")
        file_format = str(self.source.get("format") or "auto")
        if file_format not in TOKEN_FILE_FORMATS:
            raise self.error(f"token-file :format must be {', '.join(TOKEN_FILE_FORMATS)}, not {file_format}")
        try:
            layout = read_layout(path, file_format, dtype)
        except TokenFileError as err:
            raise self.error(f"{self.origin} {err}") from None
        except OSError as err:
            raise self.error(f"cannot read {self.origin}: {err.strerror or err}") from None
        self.tokens = open_tokens(path, layout)

    def _open_npy(self, path: Path) -> None:
        try:
            if path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as archive:
                    missing = [f.name for f in self.fields if f.name not in archive.files]
                    if missing:
                        raise self.error(
                            f"{self.origin} has no array named {', '.join(missing)} "
                            f"(it holds {', '.join(archive.files) or 'nothing'})"
                        )
                    self.records = {f.name: archive[f.name] for f in self.fields}
            else:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
                if array.ndim == 1 and np.issubdtype(array.dtype, np.integer):
                    self.tokens = array
                elif len(self.fields) == 1:
                    self.records = {self.fields[0].name: array}
                else:
                    raise self.error(
                        f"{self.origin} holds one array but the loader has {len(self.fields)} fields; "
                        "use an .npz with one array per field"
                    )
        # A truncated or damaged file fails in the zip reader, the decompressor or numpy's header parser.
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise self.error(f"cannot read {self.origin} as numpy data: {err or type(err).__name__}") from None
        for f in self.fields if self.records else []:
            array = self.records[f.name]
            if array.ndim == 0:
                raise self.error(f"{self.origin}: array {f.name} is a single value, not [N, *record] records")
            if array.dtype.kind not in _NUMERIC_KINDS:
                raise self.error(
                    f"{self.origin}: array {f.name} holds {array.dtype} data "
                    f"({_DTYPE_KINDS.get(array.dtype.kind, 'not numbers')}); field {f.name} is {f.dtype}, "
                    "which takes numbers"
                )
            if tuple(array.shape[1:]) != f.shape:
                raise self.error(
                    f"{self.origin}: array {f.name} has records of shape {list(array.shape[1:])}, "
                    f"the field wants {list(f.shape)}"
                )
        lengths = {len(a) for a in self.records.values()}
        if len(lengths) > 1:
            raise self.error(f"{self.origin}: the fields hold different numbers of records ({sorted(lengths)})")

    def _synthesize(self) -> np.ndarray:
        """A first-order Markov chain: each token has `branch` successors, weighted 1, 1/2, 1/3, …"""
        vocab = int(self.source.get("vocab", 0))
        count = int(self.source.get("count", 0))
        branch = int(self.source.get("branch") or 4)
        seed = int(self.source.get("seed") or 0)
        self.origin = f"(synthetic-tokens :vocab {vocab} :count {count} :seed {seed} :branch {branch})"
        if vocab < 1 or count < 1:
            raise self.error(f"synthetic-tokens needs a positive :vocab and :count, got {vocab} and {count}")
        if vocab > SYNTHETIC_MAX_VOCAB or count > SYNTHETIC_MAX_COUNT:
            raise self.error(
                f"synthetic-tokens makes at most {SYNTHETIC_MAX_COUNT} tokens of a vocabulary of at most "
                f"{SYNTHETIC_MAX_VOCAB}, got :count {count} and :vocab {vocab}; larger data belongs in a token-file"
            )
        if not 1 <= branch <= vocab:
            raise self.error(f"synthetic-tokens :branch must be between 1 and the vocabulary {vocab}, got {branch}")
        rng = np.random.default_rng(seed)
        successors = np.stack([rng.choice(vocab, size=branch, replace=False) for _ in range(vocab)])
        weights = 1.0 / np.arange(1, branch + 1)
        picks = rng.choice(branch, size=count - 1, p=weights / weights.sum()).tolist()
        table = successors.tolist()
        token = int(rng.integers(vocab))
        stream = [token]
        for pick in picks:
            token = table[token][pick]
            stream.append(token)
        return np.asarray(stream, dtype=np.int32)

    def _check_token_fields(self) -> None:
        if len(self.fields) != 1 or len(self.fields[0].shape) != 1:
            shapes = ", ".join(f"{f.name} {list(f.shape)}" for f in self.fields)
            raise self.error(
                f"a token source fills one field of shape [length] with windows of the stream; this loader has {shapes}"
            )
        if self.fields[0].dtype not in ("i32", "i64"):
            raise self.error(f"field {self.fields[0].name} of a token source must be i32 or i64, not {self.fields[0].dtype}")

    @property
    def record_count(self) -> int:
        """Distinct records in one pass: non-overlapping windows of a stream, or rows of arrays."""
        if self.tokens is not None:
            return len(self.tokens) // self.fields[0].shape[0]
        return len(next(iter(self.records.values())))

    def _check_length(self) -> None:
        if self.record_count >= self.batch:
            return
        if self.tokens is not None:
            window = self.fields[0].shape[0]
            raise self.error(
                f"{self.origin} holds {len(self.tokens)} tokens, too short for one batch of "
                f"{self.batch} windows of {window} tokens ({self.batch * window} tokens)"
            )
        raise self.error(f"{self.origin} holds {self.record_count} records, fewer than one batch of {self.batch}")

    def check_vocabulary(self, bounds: dict[str, int]) -> None:
        """Every id of a field that indexes a table must be below that table's size.

        `bounds` maps a field name to the number of ids the graphs can take (the
        smallest table any index op the field reaches gathers from).
        """
        for f in self.fields:
            bound = bounds.get(f.name)
            if bound is None:
                continue
            data = self.tokens if self.tokens is not None else self.records[f.name].reshape(-1)
            for start, chunk in _chunks(data):
                bad = (chunk >= bound) | (chunk < 0) if np.issubdtype(chunk.dtype, np.signedinteger) else chunk >= bound
                if bad.any():
                    at = int(np.argmax(bad))
                    raise self.error(
                        f"{self.origin}: token id {int(chunk[at])} at position {start + at} is outside the "
                        f"model's vocabulary of {bound} (valid ids are 0 to {bound - 1})"
                    )

    # -- drawing -------------------------------------------------------------------------------

    def _window_starts(self, position: int, count: int) -> np.ndarray:
        length = self.fields[0].shape[0]
        assert self.tokens is not None
        if self.shuffle:
            rng = np.random.default_rng([self.seed, position])
            return rng.integers(0, len(self.tokens) - length + 1, size=count)
        return ((position + np.arange(count)) % self.record_count) * length

    def _record_indices(self, position: int, count: int) -> np.ndarray:
        records = position + np.arange(count)
        if not self.shuffle:
            return records % self.record_count
        out = np.empty(count, dtype=np.int64)
        for i, record in enumerate(records.tolist()):
            epoch, offset = divmod(record, self.record_count)
            if self._permutation is None or self._permutation[0] != epoch:
                rng = np.random.default_rng([self.seed, epoch])
                self._permutation = (epoch, rng.permutation(self.record_count))
            out[i] = self._permutation[1][offset]
        return out

    def batch_at(self, position: int) -> dict[str, np.ndarray]:
        """The batch that starts at record `position`: field name → `[batch, *record]` array."""
        if self.tokens is not None:
            field = self.fields[0]
            length = field.shape[0]
            starts = self._window_starts(position, self.batch)
            # One gather of all the windows (no memmap slice per window).
            windows = np.asarray(self.tokens[starts[:, None] + np.arange(length)])
            return {field.name: windows.astype(field.numpy_dtype)}
        indices = self._record_indices(position, self.batch)
        return {f.name: np.asarray(self.records[f.name][indices]).astype(f.numpy_dtype) for f in self.fields}

    def next_batch(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.position)
        self.position += self.batch
        return batch

    def whole(self) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the loader from its start, in full batches (what an evaluation averages over).

        The pass does not move the training position, so every evaluation sees the same data.
        """
        for batch_index in range(self.record_count // self.batch):
            yield self.batch_at(batch_index * self.batch)

    def state(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def restore(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def _chunks(data: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """`data` in pieces of `_SCAN_CHUNK` elements, with where each starts. A memory-mapped file is read
    through a file handle, not its map, so a scan of the whole file leaves no page of it resident."""
    if isinstance(data, np.memmap) and data.filename is not None and data.ndim == 1:
        with open(data.filename, "rb") as f:
            for start in range(0, len(data), _SCAN_CHUNK):
                f.seek(data.offset + start * data.itemsize)
                yield start, np.fromfile(f, data.dtype, min(_SCAN_CHUNK, len(data) - start))
        return
    for start in range(0, len(data), _SCAN_CHUNK):
        yield start, np.asarray(data[start : start + _SCAN_CHUNK])


#: Ops through which token ids flow unchanged (they only move or copy them): the views, concat, cast.
_ID_CARRYING_OPS = ops_with(Trait.VIEW) | {"graph.concat", "graph.cast"}


def _index_bound(user: Any, operand_index: int) -> int | None:
    """How many ids the index op `user` can take through operand `operand_index`, or None if it is no index."""
    name, attrs = user.name, user.attributes
    if name in ("graph.take", "graph.take_along") and operand_index == 1:
        return int(user.operands[0].type.shape[attrs["axis"]])
    if name == "graph.one_hot" and operand_index == 0:
        return int(attrs["n"])
    if name in ("graph.scatter_add", "graph.scatter_add_along") and operand_index == 0:
        return int(attrs["dim"])
    return None


def vocabulary_bounds(graph: Any) -> dict[str, int]:
    """Batch field → the number of ids the graph can take for it.

    Follows each batch input through the ops that only move ids (slices,
    reshapes, casts, …) to the index ops that use them (`take`,
    `take_along`, `one_hot`, …); the bound is the smallest table reached. A
    field that indexes nothing has no bound. This is the largest valid id of
    the whole graph, which covers the embedding table and the targets of the
    loss alike.
    """
    bounds: dict[str, int] = {}
    for op in graph.regions[0].blocks[0].ops:
        if op.name != "graph.input" or op.attributes.get("role") != "batch":
            continue
        field = str(op.attributes["name"])
        pending = [op.results[0]]
        seen: set[int] = set()
        while pending:
            value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            for use in list(value.uses):
                bound = _index_bound(use.op, use.index)
                if bound is not None:
                    bounds[field] = min(bound, bounds.get(field, bound))
                elif use.op.name in _ID_CARRYING_OPS:
                    pending.extend(use.op.results)
    return bounds
