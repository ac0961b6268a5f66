"""Loaders: sources, windows, determinism, positions, and the errors raised before a run starts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.loaders import Loader, vocabulary_bounds
from sexpgpu.dialects import graph as _graph  # noqa: F401  (registers the graph ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType

from sexpgpu.diagnostics import Location, SxError

EXAMPLES_DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def make_loader(tmp_path: Path, source: dict, *, window: int = 5, batch: int = 2, shuffle: bool = False,
                seed: int = 7, fields: list | None = None) -> Loader:
    """A loader as `exp.loader` describes it, located in a .sx file inside tmp_path."""
    op = Operation.create(
        "exp.loader",
        attributes={
            "name": "train-loader",
            "source": source,
            "fields": fields or [{"name": "tokens", "shape": [window], "dtype": "i32"}],
            "batch": batch,
            "shuffle": shuffle,
            "seed": seed,
        },
        loc=Location(str(tmp_path / "run.sx"), 3, 1),
    )
    return Loader.from_op(op)


def write_u16(path: Path, tokens) -> None:
    np.asarray(tokens, dtype="<u2").tofile(path)


def test_token_file_consecutive_windows_do_not_overlap_and_wrap(tmp_path):
    write_u16(tmp_path / "t.u16", range(23))
    loader = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"})
    assert loader.record_count == 4
    first, second, third = loader.next_batch(), loader.next_batch(), loader.next_batch()
    assert first["tokens"].dtype == np.int32 and first["tokens"].shape == (2, 5)
    assert first["tokens"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert second["tokens"][1].tolist() == [15, 16, 17, 18, 19]
    assert third["tokens"].tolist() == first["tokens"].tolist()
    assert loader.position == 6


def test_u32_token_file(tmp_path):
    np.asarray(range(70_000, 70_020), dtype="<u4").tofile(tmp_path / "t.u32")
    loader = make_loader(tmp_path, {"kind": "token-file", "path": "t.u32", "dtype": "u32"},
                         fields=[{"name": "tokens", "shape": [5], "dtype": "i64"}])
    assert loader.next_batch()["tokens"][0].tolist() == [70_000, 70_001, 70_002, 70_003, 70_004]


def test_shuffled_windows_are_deterministic_and_depend_only_on_position(tmp_path):
    write_u16(tmp_path / "t.u16", range(1000))
    a = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"}, shuffle=True, batch=4)
    b = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"}, shuffle=True, batch=4)
    batches = [a.next_batch()["tokens"] for _ in range(3)]
    b.restore({"position": 8})
    assert np.array_equal(b.next_batch()["tokens"], batches[2])
    for window in np.concatenate(batches):
        assert np.array_equal(window, np.arange(window[0], window[0] + 5))
    other_seed = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"}, shuffle=True, batch=4, seed=8)
    assert not np.array_equal(other_seed.next_batch()["tokens"], batches[0])


def test_text_file_is_bytes(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"hello world, hello!")
    loader = make_loader(tmp_path, {"kind": "text-file", "path": "x.txt"}, window=4)
    assert loader.next_batch()["tokens"][0].tolist() == list(b"hell")


def test_npy_one_dimensional_is_a_token_stream(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(30, dtype=np.int64))
    loader = make_loader(tmp_path, {"kind": "npy-file", "path": "t.npy"})
    assert isinstance(loader.tokens, np.memmap)
    assert loader.next_batch()["tokens"][1].tolist() == [5, 6, 7, 8, 9]


def test_npz_records_per_field_shuffle_by_epoch_permutation(tmp_path):
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    labels = np.arange(6, dtype=np.int64)
    np.savez(tmp_path / "d.npz", x=features, y=labels)
    fields = [{"name": "x", "shape": [2], "dtype": "f32"}, {"name": "y", "shape": [], "dtype": "i32"}]
    loader = make_loader(tmp_path, {"kind": "npy-file", "path": "d.npz"}, fields=fields, batch=3, shuffle=True)
    seen = [loader.next_batch() for _ in range(2)]
    labels_seen = np.concatenate([b["y"] for b in seen])
    assert sorted(labels_seen.tolist()) == list(range(6))
    for b in seen:
        assert np.array_equal(b["x"], features[b["y"]])
        assert b["y"].dtype == np.int32


def test_synthetic_tokens_follow_a_markov_chain_with_branch_successors():
    loader = make_loader(Path("."), {"kind": "synthetic-tokens", "vocab": 50, "count": 20_000, "seed": 3, "branch": 3},
                         window=9)
    stream = loader.tokens
    again = make_loader(Path("."), {"kind": "synthetic-tokens", "vocab": 50, "count": 20_000, "seed": 3, "branch": 3},
                        window=9).tokens
    assert np.array_equal(stream, again)
    assert stream.max() < 50
    successors: dict[int, dict[int, int]] = {}
    for a, b in zip(stream[:-1].tolist(), stream[1:].tolist()):
        successors.setdefault(a, {}).setdefault(b, 0)
        successors[a][b] += 1
    assert all(len(s) <= 3 for s in successors.values())
    # Weights 1, 1/2, 1/3: the most frequent successor is taken about 6/11 of the time.
    firsts = [max(s.values()) / sum(s.values()) for s in successors.values() if sum(s.values()) > 200]
    assert abs(np.mean(firsts) - 6 / 11) < 0.05


def test_whole_pass_is_full_batches_from_the_start_and_leaves_position(tmp_path):
    write_u16(tmp_path / "t.u16", range(53))
    loader = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"}, batch=4)
    loader.next_batch()
    batches = list(loader.whole())
    assert len(batches) == 2
    assert batches[0]["tokens"][0, 0] == 0 and batches[1]["tokens"][-1, -1] == 39
    assert loader.position == 4


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "cannot read t.u16: no such file"),
        (lambda p: (p / "t.u16").write_bytes(b""), "t.u16 is empty"),
        (lambda p: (p / "t.u16").write_bytes(b"abc"), "not a whole number of u16 tokens"),
        (lambda p: write_u16(p / "t.u16", range(9)), "too short for one batch of 2 windows of 5 tokens"),
        (lambda p: (p / "t.u16").mkdir(), "cannot read t.u16: it is a directory, not a file"),
        (lambda p: os.mkfifo(p / "t.u16"), "cannot read t.u16: it is a FIFO, not a file"),
        (lambda p: (p / "t.u16").symlink_to("/dev/zero"), "cannot read t.u16: it is a character device, not a file"),
    ],
)
def test_bad_files_name_the_loader_and_the_file_at_the_defloader(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(SxError) as err:
        make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"})
    assert err.value.message.startswith("loader train-loader: ")
    assert message in err.value.message
    assert err.value.loc.line == 3


def write_blobs(path: Path, labels=None) -> None:
    np.savez(path, x=np.arange(24, dtype=np.float32).reshape(6, 4), y=np.arange(6) if labels is None else labels)


BLOB_FIELDS = [{"name": "x", "shape": [4], "dtype": "f32"}, {"name": "y", "shape": [], "dtype": "i32"}]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot read d.npz as numpy data"),
        (lambda p: p.write_bytes(p.read_bytes()[:30]), "cannot read d.npz as numpy data"),
        (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 40), "cannot read d.npz as numpy data"),
        (lambda p: write_blobs(p, np.array(["a", "b", "c", "d", "e", "f"])),
         r"d.npz: array y holds <U1 data \(text\); field y is i32, which takes numbers"),
        (lambda p: write_blobs(p, np.array([1, 2, 3, 4, 5, 6], dtype=object)), "cannot read d.npz as numpy data"),
        (lambda p: write_blobs(p, np.array(3)), "d.npz: array y is a single value"),
    ],
    ids=["truncated", "header-only", "bad-zip", "string-labels", "object-labels", "scalar"],
)
def test_damaged_or_non_numeric_npz_data_is_an_error_at_the_defloader(tmp_path, damage, message):
    path = tmp_path / "d.npz"
    write_blobs(path)
    damage(path)
    with pytest.raises(SxError, match=message) as err:
        make_loader(tmp_path, {"kind": "npy-file", "path": "d.npz"}, fields=BLOB_FIELDS, batch=2)
    assert err.value.message.startswith("loader train-loader: ") and err.value.loc.line == 3


def test_string_records_in_an_npy_file_are_an_error(tmp_path):
    np.save(tmp_path / "d.npy", np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(SxError, match=r"d.npy: array x holds <U1 data \(text\); field x is f32"):
        make_loader(tmp_path, {"kind": "npy-file", "path": "d.npy"}, fields=[BLOB_FIELDS[0] | {"shape": [2]}], batch=1)


def test_synthetic_sources_are_bounded(tmp_path):
    with pytest.raises(SxError, match="synthetic-tokens makes at most 16777216 tokens .* got :count 100000000000"):
        make_loader(tmp_path, {"kind": "synthetic-tokens", "vocab": 16, "count": 10**11, "seed": 1})


def test_token_id_outside_the_vocabulary_names_id_and_position(tmp_path):
    write_u16(tmp_path / "t.u16", [1, 2, 3, 300, 4, 5, 6, 7, 8, 9, 10])
    loader = make_loader(tmp_path, {"kind": "token-file", "path": "t.u16"})
    loader.check_vocabulary({"other": 10})
    with pytest.raises(SxError, match=r"t.u16: token id 300 at position 3 is outside the model's vocabulary of 256"):
        loader.check_vocabulary({"tokens": 256})


def test_vocabulary_bounds_follow_ids_through_slices_to_index_ops():
    func = Operation.create("graph.func", attributes={"sym_name": "train"}, regions=[Region.with_block()])
    b = Builder(func.regions[0].blocks[0])
    tokens = b.create("graph.input", attributes={"name": "tokens", "role": "batch"},
                      result_types=[TensorType((2, 9), "i32")]).results[0]
    table = b.create("graph.input", attributes={"name": "model.embed.table", "role": "param"},
                     result_types=[TensorType((256, 8), "f32")]).results[0]
    inputs = b.create("graph.slice", [tokens], {"axis": 1, "start": 0, "end": 8}).results[0]
    targets = b.create("graph.slice", [tokens], {"axis": 1, "start": 1, "end": 9}).results[0]
    b.create("graph.take", [table, inputs], {"axis": 0})
    b.create("graph.one_hot", [targets], {"n": 200})
    assert vocabulary_bounds(func) == {"tokens": 200}


def test_committed_corpus_is_what_the_generator_makes():
    spec = importlib.util.spec_from_file_location("make_corpus", EXAMPLES_DATA / "make_corpus.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, content in module.corpus_files().items():
        assert (EXAMPLES_DATA / name).read_bytes() == content, f"{name} is stale: rerun make_corpus.py"


def test_corpus_unigram_entropy_in_nats():
    tokens = np.fromfile(EXAMPLES_DATA / "train.u16", dtype="<u2")
    p = np.bincount(tokens, minlength=256) / len(tokens)
    p = p[p > 0]
    entropy = float(-(p * np.log(p)).sum())
    print(f"unigram entropy of examples/data/train.u16: {entropy:.3f} nats")
    assert 2.5 < entropy < 3.5
