"""cuBLASLt without a GPU: the enum values against the shipped headers, descriptors built and read back,
and the row-major -> column-major mapping checked by computing what the descriptors describe."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.cuda import cublaslt
from sexpgpu.backends.cuda.cublaslt import (
    ATTRIBUTE_CTYPES,
    CublasLt,
    CublasLtError,
    DataType,
    Epilogue,
    GemmSpec,
    MatmulDescAttribute,
    MatrixLayoutAttribute,
    Operation,
    Status,
    descriptors_for,
)
from sexpgpu.tools.common import guarded

# --- the values copied from the headers ----------------------------------------------------------


def _header(library: str, name: str) -> str:
    from cuda import pathfinder

    folder = pathfinder.find_nvidia_header_directory(library)
    assert folder is not None, f"the {library} headers ship with the `cuda` extra"
    return (Path(folder) / name).read_text()


def _without_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def _header_enums(texts: list[str]) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, str]]]:
    """Every `typedef enum [tag] { ... } name;` of the headers: name -> enumerator -> value, and the
    comment written before each enumerator (where the header states an attribute's C type)."""
    values: dict[str, dict[str, int]] = {}
    comments: dict[str, dict[str, str]] = {}
    known: dict[str, int] = {}
    for text in texts:
        for match in re.finditer(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
            body, name = match.groups()
            members, notes, following, searched_from = {}, {}, 0, 0
            for entry in filter(None, (e.strip() for e in _without_comments(body).split(","))):
                enumerator, _, expression = (part.strip() for part in entry.partition("="))
                value = eval(expression, {}, dict(known)) if expression else following  # noqa: S307
                members[enumerator] = known[enumerator] = value
                following = value + 1
                at = re.compile(r"\b" + enumerator + r"\b\s*(?:=|,|$)").search(body, searched_from)
                notes[enumerator] = body[searched_from:at.start()]
                searched_from = at.end()
            values[name], comments[name] = members, notes
    return values, comments


@pytest.fixture(scope="module")
def headers():
    return _header_enums([_header("cudart", "library_types.h"), _header("cublas", "cublas_api.h"),
                          _header("cublas", "cublasLt.h")])


ENUMS = {
    cublaslt.DataType: "cudaDataType",
    cublaslt.ComputeType: "cublasComputeType_t",
    cublaslt.Operation: "cublasOperation_t",
    cublaslt.Status: "cublasStatus_t",
    cublaslt.Order: "cublasLtOrder_t",
    cublaslt.MatmulDescAttribute: "cublasLtMatmulDescAttributes_t",
    cublaslt.MatrixLayoutAttribute: "cublasLtMatrixLayoutAttribute_t",
    cublaslt.Epilogue: "cublasLtEpilogue_t",
    cublaslt.PreferenceAttribute: "cublasLtMatmulPreferenceAttributes_t",
}


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
def test_enum_values_match_the_headers(headers, enum):
    values, _ = headers
    in_header = values[ENUMS[enum]]
    assert {m.name: m.value for m in enum} == {m.name: in_header[m.name] for m in enum}


def test_the_header_parser_reads_expressions(headers):
    values, _ = headers
    epilogues = values["cublasLtEpilogue_t"]
    assert epilogues["CUBLASLT_EPILOGUE_RELU_AUX_BIAS"] == 2 | 128 | 4  # written as (RELU_AUX | BIAS)
    assert epilogues["CUBLASLT_EPILOGUE_DGELU_BGRAD"] == 64 | 128 | 16
    assert values["cublasFillMode_t"] == {"CUBLAS_FILL_MODE_LOWER": 0, "CUBLAS_FILL_MODE_UPPER": 1,
                                          "CUBLAS_FILL_MODE_FULL": 2}


_C_TYPES = {"int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64,
            "uint64_t": ctypes.c_uint64, "void *": ctypes.c_void_p}


@pytest.mark.parametrize("enum", list(ATTRIBUTE_CTYPES), ids=lambda e: e.__name__)
def test_attribute_value_types_match_the_headers(headers, enum):
    _, comments = headers
    notes = comments[ENUMS[enum]]
    for attribute, ctype in ATTRIBUTE_CTYPES[enum].items():
        stated = re.findall(r"(?:const\s+)?void\s*\*|\bu?int(?:32|64)_t\b", notes[attribute.name])
        assert stated, attribute.name
        c_type = "void *" if "void" in stated[-1] else stated[-1]  # the last paragraph states the type
        assert _C_TYPES[c_type] is ctype, attribute.name


def test_heuristic_result_struct_matches_the_header():
    text = _without_comments(_header("cublas", "cublasLt.h"))

    def members(struct: str) -> list[tuple[str, str, int]]:
        body = re.search(r"typedef\s+struct\s*\{([^}]*)\}\s*" + struct + r"\s*;", text).group(1)
        return [(kind, name, int(count or 1))
                for kind, name, count in re.findall(r"(\w+)\s+(\w+)\s*(?:\[(\d+)\])?\s*;", body)]

    assert members("cublasLtMatmulAlgo_t") == [("uint64_t", "data", 8)]
    c_types = {"cublasLtMatmulAlgo_t": ctypes.c_uint64 * 8, "size_t": ctypes.c_size_t, "cublasStatus_t": ctypes.c_int,
               "float": ctypes.c_float, "int": ctypes.c_int}
    expected = [(name, c_types[kind] if count == 1 else c_types[kind] * count)
                for kind, name, count in members("cublasLtMatmulHeuristicResult_t")]
    actual = cublaslt.MatmulHeuristicResult._fields_
    assert [name for name, _ in actual] == [name for name, _ in expected]
    for (_, ours), (_, theirs) in zip(actual, expected):
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs) and ctypes.alignment(ours) == ctypes.alignment(theirs)


# --- descriptors, read back -------------------------------------------------------------------------

SPECS = {
    "NN f32": GemmSpec(64, 48, 32),
    "NT bf16": GemmSpec(64, 48, 32, transpose_b=True, dtype="bf16"),
    "TN bf16 to f32": GemmSpec(64, 48, 32, transpose_a=True, dtype="bf16", out_dtype="f32"),
    "TT f32": GemmSpec(20, 12, 28, transpose_a=True, transpose_b=True),
    "batched NT bf16": GemmSpec(16, 16, 8, transpose_b=True, dtype="bf16", batch=12),
    "batched broadcast B": GemmSpec(16, 24, 8, batch=3, stride_b=0),
    "padded rows": GemmSpec(10, 6, 4, lda=8, ldb=16, ldc=9),
    "bias bf16": GemmSpec(64, 768, 32, dtype="bf16", epilogue="bias"),
    "batched bias": GemmSpec(8, 12, 4, batch=2, epilogue="bias"),
    "gelu-bias": GemmSpec(64, 96, 32, dtype="bf16", epilogue="gelu-bias"),
    # a linear layer's weight gradient x^T @ dy, its bias gradient summed from dy: B's
    "weight grad, bias-grad-b": GemmSpec(24, 40, 56, transpose_a=True, epilogue="bias-grad-b"),
    "bias-grad-a": GemmSpec(24, 40, 56, transpose_b=True, dtype="bf16", epilogue="bias-grad-a"),
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_descriptors_read_back_what_was_set(spec):
    descriptors = cublaslt.GemmDescriptors(spec)
    problem = spec.column_major()
    assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_COMPUTE_TYPE) == 68
    assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_SCALE_TYPE) == DataType.CUDA_R_32F
    assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSA) == problem.transa
    assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSB) == problem.transb
    assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_EPILOGUE) == problem.epilogue
    bias_type = descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE)
    assert bias_type == (problem.bias_dtype if problem.bias_dtype is not None else -1)  # -1: D's type
    for which in "abcd":
        layout = getattr(problem, which)
        read = {a: descriptors.layout_attribute(which, a) for a in MatrixLayoutAttribute}
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_TYPE] == layout.dtype
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_ORDER] == cublaslt.Order.CUBLASLT_ORDER_COL
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_ROWS] == layout.rows
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_COLS] == layout.cols
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_LD] == layout.ld
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT] == layout.batch
        expected_stride = layout.batch_stride if layout.batch > 1 else 0
        assert read[MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET] == expected_stride
    descriptors.close()


def test_row_major_nt_as_column_major():
    problem = GemmSpec(64, 48, 32, transpose_b=True, dtype="bf16").column_major()
    # D^T[48, 64] = op(B)^T @ op(A)^T: cuBLASLt's A is our B stored [n, k] = column-major [k, n], transposed.
    assert problem.transa == Operation.CUBLAS_OP_T and problem.transb == Operation.CUBLAS_OP_N
    assert (problem.a.rows, problem.a.cols, problem.a.ld) == (32, 48, 32)
    assert (problem.b.rows, problem.b.cols, problem.b.ld) == (32, 64, 32)
    assert (problem.d.rows, problem.d.cols, problem.d.ld) == (48, 64, 48)
    assert problem.a.dtype == DataType.CUDA_R_16BF and problem.d.dtype == DataType.CUDA_R_16BF


def test_bias_gradient_epilogues_swap_with_the_operands():
    assert GemmSpec(8, 8, 8, epilogue="bias-grad-b").column_major().epilogue == Epilogue.CUBLASLT_EPILOGUE_BGRADA
    assert GemmSpec(8, 8, 8, epilogue="bias-grad-a").column_major().epilogue == Epilogue.CUBLASLT_EPILOGUE_BGRADB


def test_the_bias_pointer_is_set_per_call():
    descriptors = descriptors_for(SPECS["bias bf16"])
    assert descriptors_for(SPECS["bias bf16"]) is descriptors
    for pointer in (0x7F0000001000, 0x7F0000002100):
        descriptors.set_bias(pointer)
        assert descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_POINTER) == pointer


# --- the descriptors compute the row-major product -------------------------------------------------


def _column_major(buffer: np.ndarray, rows: int, cols: int, ld: int, offset: int) -> np.ndarray:
    item = buffer.itemsize
    return np.lib.stride_tricks.as_strided(buffer[offset:], shape=(rows, cols), strides=(item, ld * item))


def _row_major(buffer: np.ndarray, rows: int, cols: int, ld: int, offset: int) -> np.ndarray:
    item = buffer.itemsize
    return np.lib.stride_tricks.as_strided(buffer[offset:], shape=(rows, cols), strides=(ld * item, item))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _as_cublaslt_computes(descriptors, a, b, d, bias, alpha, beta):
    """cublasLtMatmul's column-major semantics, driven only by what the descriptors read back; cuBLASLt's
    A is our B's buffer and its B our A's."""
    def layout(which):
        get = descriptors.layout_attribute
        return (get(which, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_ROWS),
                get(which, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_COLS),
                get(which, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_LD),
                get(which, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT),
                get(which, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET))

    transa = descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSA)
    transb = descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSB)
    epilogue = descriptors.matmul_attribute(MatmulDescAttribute.CUBLASLT_MATMUL_DESC_EPILOGUE)
    (ar, ac, ald, batch, astride), (br, bc, bld, _, bstride) = layout("a"), layout("b")
    dr, dc, dld, _, dstride = layout("d")
    for i in range(batch):
        op_a = _column_major(b, ar, ac, ald, i * astride)  # cuBLASLt's A: our B's buffer
        op_b = _column_major(a, br, bc, bld, i * bstride)
        op_a = op_a.T if transa == Operation.CUBLAS_OP_T else op_a
        op_b = op_b.T if transb == Operation.CUBLAS_OP_T else op_b
        assert op_a.shape[1] == op_b.shape[0] and (op_a.shape[0], op_b.shape[1]) == (dr, dc)
        out = _column_major(d, dr, dc, dld, i * dstride)
        value = alpha * (op_a @ op_b) + beta * out
        if epilogue & Epilogue.CUBLASLT_EPILOGUE_BIAS:
            value = value + bias[:dr, None]
        if epilogue & Epilogue.CUBLASLT_EPILOGUE_GELU:
            value = _gelu_tanh(value)
        if epilogue == Epilogue.CUBLASLT_EPILOGUE_BGRADA:
            bias[:dr] = op_a.sum(axis=1)
        if epilogue == Epilogue.CUBLASLT_EPILOGUE_BGRADB:
            bias[:dc] = op_b.sum(axis=0)
        out[...] = value


def _row_major_reference(spec: GemmSpec, a, b, d, bias, alpha, beta):
    for i in range(spec.batch):
        op_a = _row_major(a, *spec.a_stored, spec.row_length_a, i * spec.batch_stride_a)
        op_b = _row_major(b, *spec.b_stored, spec.row_length_b, i * spec.batch_stride_b)
        op_a = op_a.T if spec.transpose_a else op_a
        op_b = op_b.T if spec.transpose_b else op_b
        out = _row_major(d, spec.m, spec.n, spec.row_length_c, i * spec.batch_stride_c)
        value = alpha * (op_a @ op_b) + beta * out
        if spec.epilogue in ("bias", "gelu-bias"):
            value = value + bias[None, :spec.n]
        if spec.epilogue in ("gelu", "gelu-bias"):
            value = _gelu_tanh(value)
        if spec.epilogue == "bias-grad-b":
            bias[:spec.n] = op_b.sum(axis=0)  # over k: one value per output column
        if spec.epilogue == "bias-grad-a":
            bias[:spec.m] = op_a.sum(axis=1)  # over k: one value per output row
        out[...] = value


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_descriptors_describe_the_row_major_product(spec):
    rng = np.random.default_rng(0)

    def buffer(stored, ld, stride):
        return rng.standard_normal(max(stride, 1) * spec.batch + stored[0] * ld)

    a = buffer(spec.a_stored, spec.row_length_a, spec.batch_stride_a)
    b = buffer(spec.b_stored, spec.row_length_b, spec.batch_stride_b)
    d = buffer((spec.m, spec.n), spec.row_length_c, spec.batch_stride_c)
    bias = rng.standard_normal(max(spec.m, spec.n))
    expected_d, expected_bias = d.copy(), bias.copy()
    _row_major_reference(spec, a, b, expected_d, expected_bias, alpha=0.5, beta=2.0)
    _as_cublaslt_computes(descriptors_for(spec), a, b, d, bias, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(d, expected_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bias, expected_bias, rtol=1e-12, atol=1e-12)


# --- specs cuBLASLt cannot take are refused before it sees them --------------------------------------


@pytest.mark.parametrize(("arguments", "message"), [
    ({"dtype": "f32", "out_dtype": "bf16"}, "no f32-compute GEMM from f32 to bf16"),
    ({"dtype": "f16"}, "no f32-compute GEMM from f16 to f16"),
    ({"epilogue": "relu"}, "unknown epilogue 'relu'"),
    ({"lda": 4}, "lda=4 is shorter than the stored row of 8 elements"),
    ({"batch": 2, "epilogue": "bias-grad-b"}, "bias-gradient epilogue sums one GEMM"),
    ({"m": 0}, "positive m, n, k and batch"),
])
def test_invalid_specs(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GemmSpec(**{"m": 4, "n": 6, "k": 8, **arguments})


# --- the calls that need a GPU ----------------------------------------------------------------------


def test_gpu_calls_marshal_their_arguments_and_are_refused_without_a_handle():
    """With no handle cuBLASLt refuses the heuristic and the matmul (NOT_INITIALIZED) instead of crashing:
    every argument of both calls went through ctypes as declared."""
    runner = CublasLt.__new__(CublasLt)
    runner.workspace, runner.workspace_bytes, runner.handle, runner._algorithms = 0, cublaslt.WORKSPACE_BYTES, None, {}
    spec = SPECS["bias bf16"]
    with pytest.raises(CublasLtError) as refused:
        runner.matmul(spec, a=0x1000, b=0x2000, d=0x3000, bias=0x4000)
    assert refused.value.call == "cublasLtMatmulAlgoGetHeuristic"
    assert refused.value.status == Status.CUBLAS_STATUS_NOT_INITIALIZED
    runner._algorithms[(spec, (256, 256, 256, 256, 256))] = cublaslt.MatmulHeuristicResult()
    with pytest.raises(CublasLtError) as refused:
        runner.matmul(spec, a=0x1000, b=0x2000, d=0x3000, bias=0x4000, beta=1.0)
    assert refused.value.call == "cublasLtMatmul"
    assert refused.value.status == Status.CUBLAS_STATUS_NOT_INITIALIZED


def test_a_bias_epilogue_needs_its_pointer():
    runner = CublasLt.__new__(CublasLt)
    with pytest.raises(ValueError, match="needs bias pointer"):
        runner.matmul(SPECS["bias bf16"], a=0x1000, b=0x2000, d=0x3000)
    with pytest.raises(ValueError, match="takes no bias pointer"):
        runner.matmul(SPECS["NN f32"], a=0x1000, b=0x2000, d=0x3000, bias=0x4000)


def test_alignment_assumed_of_a_matrix():
    assert cublaslt._alignment(0x7F0000001000) == 256
    assert cublaslt._alignment(0x7F0000001010) == 16
    assert cublaslt._alignment(0x7F0000001000, 0) == 256  # one batch: no stride
    assert cublaslt._alignment(0x7F0000001000, 15 * 2) == 2  # batches 15 bf16 values apart


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch


GPU_SPECS = {name: spec for name, spec in SPECS.items() if spec.lda is None and spec.stride_b is None}


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS.values(), ids=GPU_SPECS.keys())
def test_matmul_on_a_gpu_equals_torch(spec):
    torch = _torch_cuda()
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(shape, dtype):
        return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(dtypes[dtype])

    a = tensor((spec.batch, *spec.a_stored), spec.dtype)
    b = tensor((spec.batch, *spec.b_stored), spec.dtype)
    d = tensor((spec.batch, spec.m, spec.n), spec.output_dtype)
    bias = tensor((max(spec.m, spec.n),), spec.output_dtype)
    op_a = a.float().transpose(1, 2) if spec.transpose_a else a.float()
    op_b = b.float().transpose(1, 2) if spec.transpose_b else b.float()
    expected = op_a @ op_b + d.float()
    if spec.epilogue in ("bias", "gelu-bias"):
        expected = expected + bias.float()[: spec.n]
    if spec.epilogue in ("gelu", "gelu-bias"):
        expected = torch.nn.functional.gelu(expected, approximate="tanh")
    expected_bias = {"bias-grad-b": op_b[0].sum(0), "bias-grad-a": op_a[0].sum(1)}.get(spec.epilogue)
    workspace = torch.empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    runner = CublasLt(workspace.data_ptr())
    stream = torch.cuda.current_stream()
    runner.matmul(spec, a.data_ptr(), b.data_ptr(), d.data_ptr(), beta=1.0, stream=stream.cuda_stream,
                  bias=bias.data_ptr() if spec.epilogue in cublaslt.BIAS_EPILOGUES else None)
    stream.synchronize()
    tolerance = 2e-2 if "bf16" in (spec.dtype, spec.output_dtype) else 1e-4
    torch.testing.assert_close(d.float(), expected, rtol=tolerance, atol=tolerance * 8)
    if expected_bias is not None:
        torch.testing.assert_close(bias.float()[: expected_bias.numel()], expected_bias, rtol=tolerance,
                                   atol=tolerance * 8)
    runner.close()


# --- without the `cuda` extra ---------------------------------------------------------------------


def test_without_the_cublas_wheel_one_line_names_the_install_command(monkeypatch, capsys):
    from cuda import pathfinder

    def not_found(name):
        raise pathfinder.DynamicLibNotFoundError(f"Failure finding lib{name}.so")

    cublaslt.cublaslt_library.cache_clear()
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    try:
        assert guarded(lambda: cublaslt.GemmDescriptors(GemmSpec(8, 8, 8))) == 1
    finally:
        cublaslt.cublaslt_library.cache_clear()
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the cuBLASLt library (libcublasLt, wheel nvidia-cublas) is not installed")
    assert "pip install 'sexpgpu[cuda]'" in line
