"""GEMMs through cuBLASLt: a row-major `GemmSpec`, its descriptors, and the calls that need a GPU.

sexpgpu's tensors are row-major; cuBLASLt's matrices are column-major. A row-major [r, c] matrix
is, byte for byte, the column-major [c, r] matrix that is its transpose, so the row-major product
C = op(A) @ op(B) is computed as the column-major Cᵀ = op(B)ᵀ @ op(A)ᵀ: cuBLASLt's "A" is our B, its
"B" our A, and its m and n are our n and m. The bias of a row-major linear layer (one value per
output column) is then a per-row bias of cuBLASLt's D, which is what its BIAS epilogue adds.

libcublasLt comes from the `nvidia-cublas` wheel, found by cuda-pathfinder and called through
ctypes. It loads without a driver, and descriptors need no handle, so `GemmDescriptors` is built and
read back on any machine; `CublasLt` (handle, heuristic, `cublasLtMatmul`) needs a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from enum import IntEnum

from attrs import frozen

from .errors import CudaToolchainMissing

# The enum values below are copied from the headers shipped in the nvidia-cublas and
# nvidia-cuda-runtime 13.0 wheels; test_cublaslt.py parses those headers and checks every one.
# Member names are the C enumerators'.


class DataType(IntEnum):
    """cudaDataType_t (library_types.h)."""

    CUDA_R_32F = 0
    CUDA_R_16F = 2
    CUDA_R_16BF = 14


class ComputeType(IntEnum):
    """cublasComputeType_t (cublas_api.h)."""

    CUBLAS_COMPUTE_32F = 68


class Operation(IntEnum):
    """cublasOperation_t (cublas_api.h)."""

    CUBLAS_OP_N = 0
    CUBLAS_OP_T = 1


class Status(IntEnum):
    """cublasStatus_t (cublas_api.h)."""

    CUBLAS_STATUS_SUCCESS = 0
    CUBLAS_STATUS_NOT_INITIALIZED = 1
    CUBLAS_STATUS_ALLOC_FAILED = 3
    CUBLAS_STATUS_INVALID_VALUE = 7
    CUBLAS_STATUS_ARCH_MISMATCH = 8
    CUBLAS_STATUS_MAPPING_ERROR = 11
    CUBLAS_STATUS_EXECUTION_FAILED = 13
    CUBLAS_STATUS_INTERNAL_ERROR = 14
    CUBLAS_STATUS_NOT_SUPPORTED = 15
    CUBLAS_STATUS_LICENSE_ERROR = 16


class Order(IntEnum):
    """cublasLtOrder_t (cublasLt.h)."""

    CUBLASLT_ORDER_COL = 0


class MatmulDescAttribute(IntEnum):
    """cublasLtMatmulDescAttributes_t (cublasLt.h)."""

    CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0
    CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1
    CUBLASLT_MATMUL_DESC_POINTER_MODE = 2
    CUBLASLT_MATMUL_DESC_TRANSA = 3
    CUBLASLT_MATMUL_DESC_TRANSB = 4
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8
    CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26


class MatrixLayoutAttribute(IntEnum):
    """cublasLtMatrixLayoutAttribute_t (cublasLt.h)."""

    CUBLASLT_MATRIX_LAYOUT_TYPE = 0
    CUBLASLT_MATRIX_LAYOUT_ORDER = 1
    CUBLASLT_MATRIX_LAYOUT_ROWS = 2
    CUBLASLT_MATRIX_LAYOUT_COLS = 3
    CUBLASLT_MATRIX_LAYOUT_LD = 4
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6


class Epilogue(IntEnum):
    """cublasLtEpilogue_t (cublasLt.h)."""

    CUBLASLT_EPILOGUE_DEFAULT = 1
    CUBLASLT_EPILOGUE_BIAS = 4
    CUBLASLT_EPILOGUE_GELU = 32
    CUBLASLT_EPILOGUE_GELU_BIAS = 36
    CUBLASLT_EPILOGUE_BGRADA = 256
    CUBLASLT_EPILOGUE_BGRADB = 512


class PreferenceAttribute(IntEnum):
    """cublasLtMatmulPreferenceAttributes_t (cublasLt.h)."""

    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8


#: The C type of each attribute's value, as its comment in cublasLt.h states (checked by the tests);
#: cuBLASLt refuses a value of another size. One table per enum: their values overlap.
ATTRIBUTE_CTYPES: dict[type[IntEnum], dict[int, type]] = {
    MatmulDescAttribute: {
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: ctypes.c_int32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_SCALE_TYPE: ctypes.c_int32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_POINTER_MODE: ctypes.c_int32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSA: ctypes.c_int32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSB: ctypes.c_int32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_EPILOGUE: ctypes.c_uint32,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_POINTER: ctypes.c_void_p,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE: ctypes.c_int64,
        MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: ctypes.c_int32,
    },
    MatrixLayoutAttribute: {
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_TYPE: ctypes.c_uint32,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_ORDER: ctypes.c_int32,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_ROWS: ctypes.c_uint64,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_COLS: ctypes.c_uint64,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_LD: ctypes.c_int64,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: ctypes.c_int32,
        MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: ctypes.c_int64,
    },
    PreferenceAttribute: {
        PreferenceAttribute.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: ctypes.c_uint64,
        PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: ctypes.c_uint32,
        PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: ctypes.c_uint32,
        PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: ctypes.c_uint32,
        PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: ctypes.c_uint32,
    },
}


class MatmulHeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t; `algo` is the opaque cublasLtMatmulAlgo_t (uint64_t data[8])."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    """A cuBLASLt call that failed; `status` is its cublasStatus_t."""

    def __init__(self, call: str, status: int) -> None:
        name = Status(status).name if status in Status._value2member_map_ else f"status {status}"
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.status = status


# --- the library ---------------------------------------------------------------------------------

_handle = ctypes.c_void_p
_p_handle = ctypes.POINTER(ctypes.c_void_p)
_PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "cublasLtGetVersion": (ctypes.c_size_t, []),
    "cublasLtCreate": (ctypes.c_int, [_p_handle]),
    "cublasLtDestroy": (ctypes.c_int, [_handle]),
    "cublasLtMatmulDescCreate": (ctypes.c_int, [_p_handle, ctypes.c_int, ctypes.c_int]),
    "cublasLtMatmulDescDestroy": (ctypes.c_int, [_handle]),
    "cublasLtMatmulDescSetAttribute": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]),
    "cublasLtMatmulDescGetAttribute": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                                      ctypes.POINTER(ctypes.c_size_t)]),
    "cublasLtMatrixLayoutCreate": (ctypes.c_int, [_p_handle, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                                  ctypes.c_int64]),
    "cublasLtMatrixLayoutDestroy": (ctypes.c_int, [_handle]),
    "cublasLtMatrixLayoutSetAttribute": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]),
    "cublasLtMatrixLayoutGetAttribute": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                                        ctypes.POINTER(ctypes.c_size_t)]),
    "cublasLtMatmulPreferenceCreate": (ctypes.c_int, [_p_handle]),
    "cublasLtMatmulPreferenceDestroy": (ctypes.c_int, [_handle]),
    "cublasLtMatmulPreferenceSetAttribute": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]),
    "cublasLtMatmulAlgoGetHeuristic": (ctypes.c_int, [_handle, _handle, _handle, _handle, _handle, _handle, _handle,
                                                      ctypes.c_int, ctypes.POINTER(MatmulHeuristicResult),
                                                      ctypes.POINTER(ctypes.c_int)]),
    "cublasLtMatmul": (ctypes.c_int, [_handle, _handle, ctypes.c_void_p, ctypes.c_void_p, _handle, ctypes.c_void_p,
                                      _handle, ctypes.c_void_p, ctypes.c_void_p, _handle, ctypes.c_void_p, _handle,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
}


@functools.cache
def cublaslt_library() -> ctypes.CDLL:
    """libcublasLt with the prototypes this module calls; `CudaToolchainMissing` without the `cuda` extra."""
    needed_for = "running GEMMs with cuBLASLt"
    try:
        from cuda import pathfinder
    except ImportError as err:
        raise CudaToolchainMissing(f"cuda-pathfinder is not installed ({err})", needed_for) from None
    try:
        path = pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path
    except pathfinder.DynamicLibNotFoundError:
        raise CudaToolchainMissing("the cuBLASLt library (libcublasLt, wheel nvidia-cublas) is not installed",
                                   needed_for) from None
    library = ctypes.CDLL(path)
    for name, (restype, argtypes) in _PROTOTYPES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def _call(name: str, *arguments) -> None:
    status = getattr(cublaslt_library(), name)(*arguments)
    if status != Status.CUBLAS_STATUS_SUCCESS:
        raise CublasLtError(name, status)


def _set(setter: str, descriptor: int, attribute: IntEnum, value: int) -> None:
    buffer = ATTRIBUTE_CTYPES[type(attribute)][attribute](value)
    _call(setter, descriptor, attribute, ctypes.byref(buffer), ctypes.sizeof(buffer))


def _get(getter: str, descriptor: int, attribute: IntEnum) -> int:
    buffer = ATTRIBUTE_CTYPES[type(attribute)][attribute]()
    written = ctypes.c_size_t()
    _call(getter, descriptor, attribute, ctypes.byref(buffer), ctypes.sizeof(buffer), ctypes.byref(written))
    if written.value != ctypes.sizeof(buffer):
        raise CublasLtError(f"{getter}({attribute.name}) wrote {written.value} bytes", Status.CUBLAS_STATUS_INVALID_VALUE)
    return buffer.value or 0  # a NULL c_void_p reads as None


# --- what to compute -------------------------------------------------------------------------------

DTYPES = {"f32": DataType.CUDA_R_32F, "bf16": DataType.CUDA_R_16BF}
ELEMENT_BYTES = {"f32": 4, "bf16": 2}
#: (input dtype, output dtype) pairs cuBLASLt computes with CUBLAS_COMPUTE_32F and an f32 scale.
SUPPORTED_DTYPES = {("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")}

#: Row-major epilogues -> cuBLASLt's. cuBLASLt's A is our B, so the bias gradient of op(B) (its sum
#: over k, one value per output column: a linear layer's bias gradient when B is the output gradient)
#: is BGRADA, and that of op(A) (one value per output row) is BGRADB. GELU is cuBLASLt's tanh
#: approximation: a caller asks for it only where the graph's GELU is that same function.
EPILOGUES = {
    "none": Epilogue.CUBLASLT_EPILOGUE_DEFAULT,
    "bias": Epilogue.CUBLASLT_EPILOGUE_BIAS,
    "gelu": Epilogue.CUBLASLT_EPILOGUE_GELU,
    "gelu-bias": Epilogue.CUBLASLT_EPILOGUE_GELU_BIAS,
    "bias-grad-a": Epilogue.CUBLASLT_EPILOGUE_BGRADB,
    "bias-grad-b": Epilogue.CUBLASLT_EPILOGUE_BGRADA,
}
#: Epilogues that read or write the vector at the bias pointer.
BIAS_EPILOGUES = {"bias", "gelu-bias", "bias-grad-a", "bias-grad-b"}


@frozen
class GemmSpec:
    """D[m, n] = alpha · op(A)[m, k] @ op(B)[k, n] + beta · C[m, n], every matrix row-major.

    A is stored [m, k], or [k, m] with `transpose_a`; B is stored [k, n], or [n, k] with
    `transpose_b`. `lda`, `ldb`, `ldc` are the stored row lengths in elements (default: contiguous).
    With `batch` > 1 the product is repeated over strided batches; `stride_*` are in elements
    (default: packed; 0 repeats the same matrix for every batch). `dtype` is A's and B's, `out_dtype`
    C's and D's (default: `dtype`); products accumulate in f32. alpha and beta are given per call.
    The bias (or bias gradient) vector has `out_dtype` and is the same for every batch.
    """

    m: int
    n: int
    k: int
    transpose_a: bool = False
    transpose_b: bool = False
    dtype: str = "f32"
    out_dtype: str | None = None
    batch: int = 1
    stride_a: int | None = None
    stride_b: int | None = None
    stride_c: int | None = None
    lda: int | None = None
    ldb: int | None = None
    ldc: int | None = None
    epilogue: str = "none"

    def __attrs_post_init__(self) -> None:
        if min(self.m, self.n, self.k, self.batch) < 1:
            raise ValueError(f"a GEMM needs positive m, n, k and batch: {self}")
        if (self.dtype, self.output_dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"cuBLASLt has no f32-compute GEMM from {self.dtype} to {self.output_dtype}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {self.epilogue!r}; one of {', '.join(EPILOGUES)}")
        if self.epilogue.startswith("bias-grad") and self.batch > 1:
            raise ValueError("a bias-gradient epilogue sums one GEMM's operand over k; fold the batch into k")
        for stored, ld, name in ((self.a_stored, self.row_length_a, "lda"), (self.b_stored, self.row_length_b, "ldb"),
                                 ((self.m, self.n), self.row_length_c, "ldc")):
            if ld < stored[1]:
                raise ValueError(f"{name}={ld} is shorter than the stored row of {stored[1]} elements")

    @property
    def output_dtype(self) -> str:
        return self.out_dtype or self.dtype

    @property
    def a_stored(self) -> tuple[int, int]:
        return (self.k, self.m) if self.transpose_a else (self.m, self.k)

    @property
    def b_stored(self) -> tuple[int, int]:
        return (self.n, self.k) if self.transpose_b else (self.k, self.n)

    @property
    def row_length_a(self) -> int:
        return self.lda or self.a_stored[1]

    @property
    def row_length_b(self) -> int:
        return self.ldb or self.b_stored[1]

    @property
    def row_length_c(self) -> int:
        return self.ldc or self.n

    @property
    def batch_stride_a(self) -> int:
        return self.a_stored[0] * self.row_length_a if self.stride_a is None else self.stride_a

    @property
    def batch_stride_b(self) -> int:
        return self.b_stored[0] * self.row_length_b if self.stride_b is None else self.stride_b

    @property
    def batch_stride_c(self) -> int:
        return self.m * self.row_length_c if self.stride_c is None else self.stride_c

    def column_major(self) -> ColumnMajorGemm:
        """The column-major problem cuBLASLt is given: Dᵀ[n, m] = op(B)ᵀ @ op(A)ᵀ."""
        out = DTYPES[self.output_dtype]
        # A row-major [r, c] matrix with row length ld is the column-major [c, r] one with the same ld.
        b_rows, b_cols = self.b_stored
        a_rows, a_cols = self.a_stored
        return ColumnMajorGemm(
            transa=Operation.CUBLAS_OP_T if self.transpose_b else Operation.CUBLAS_OP_N,
            transb=Operation.CUBLAS_OP_T if self.transpose_a else Operation.CUBLAS_OP_N,
            a=MatrixLayout(DTYPES[self.dtype], b_cols, b_rows, self.row_length_b, self.batch, self.batch_stride_b),
            b=MatrixLayout(DTYPES[self.dtype], a_cols, a_rows, self.row_length_a, self.batch, self.batch_stride_a),
            c=MatrixLayout(out, self.n, self.m, self.row_length_c, self.batch, self.batch_stride_c),
            d=MatrixLayout(out, self.n, self.m, self.row_length_c, self.batch, self.batch_stride_c),
            epilogue=EPILOGUES[self.epilogue],
            bias_dtype=out if self.epilogue in BIAS_EPILOGUES else None,
        )


@frozen
class MatrixLayout:
    """One column-major cuBLASLt matrix: element (i, j) of batch b at b·batch_stride + i + j·ld."""

    dtype: DataType
    rows: int
    cols: int
    ld: int
    batch: int
    batch_stride: int


@frozen
class ColumnMajorGemm:
    """A GEMM as cuBLASLt sees it: D = op(A) @ op(B) (+ C), column-major, with its epilogue."""

    transa: Operation
    transb: Operation
    a: MatrixLayout
    b: MatrixLayout
    c: MatrixLayout
    d: MatrixLayout
    epilogue: Epilogue
    bias_dtype: DataType | None


# --- descriptors (no GPU needed) -------------------------------------------------------------------

class GemmDescriptors:
    """The matmul descriptor and the A, B, C, D layouts of one `GemmSpec`, owned and freed together."""

    def __init__(self, spec: GemmSpec) -> None:
        self.spec = spec
        self.problem = spec.column_major()
        self._handles: list[tuple[str, int]] = []  # (destroyer, handle), freed in reverse
        self._finalizer = weakref.finalize(self, _destroy_descriptors, cublaslt_library(), self._handles)
        problem = self.problem
        self.matmul = _create("cublasLtMatmulDescCreate", ComputeType.CUBLAS_COMPUTE_32F, DataType.CUDA_R_32F)
        self._handles.append(("cublasLtMatmulDescDestroy", self.matmul))
        setter = "cublasLtMatmulDescSetAttribute"
        _set(setter, self.matmul, MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSA, problem.transa)
        _set(setter, self.matmul, MatmulDescAttribute.CUBLASLT_MATMUL_DESC_TRANSB, problem.transb)
        _set(setter, self.matmul, MatmulDescAttribute.CUBLASLT_MATMUL_DESC_EPILOGUE, problem.epilogue)
        if problem.bias_dtype is not None:
            _set(setter, self.matmul, MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, problem.bias_dtype)
        self.a, self.b, self.c, self.d = (self._layout(layout) for layout in (problem.a, problem.b, problem.c, problem.d))

    def _layout(self, layout: MatrixLayout) -> int:
        handle = _create("cublasLtMatrixLayoutCreate", layout.dtype, layout.rows, layout.cols, layout.ld)
        self._handles.append(("cublasLtMatrixLayoutDestroy", handle))
        if layout.batch > 1:
            setter = "cublasLtMatrixLayoutSetAttribute"
            _set(setter, handle, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, layout.batch)
            _set(setter, handle, MatrixLayoutAttribute.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, layout.batch_stride)
        return handle

    def matmul_attribute(self, attribute: MatmulDescAttribute) -> int:
        """An attribute of the matmul descriptor, read back from cuBLASLt."""
        return _get("cublasLtMatmulDescGetAttribute", self.matmul, attribute)

    def layout_attribute(self, which: str, attribute: MatrixLayoutAttribute) -> int:
        """An attribute of layout `which` ("a", "b", "c" or "d", in cuBLASLt's naming), read back from cuBLASLt."""
        return _get("cublasLtMatrixLayoutGetAttribute", getattr(self, which), attribute)

    def set_bias(self, pointer: int) -> None:
        """Point the epilogue at the bias (or bias-gradient) vector for the next call."""
        _set("cublasLtMatmulDescSetAttribute", self.matmul, MatmulDescAttribute.CUBLASLT_MATMUL_DESC_BIAS_POINTER,
             pointer)

    def close(self) -> None:
        self._finalizer()


def _create(creator: str, *arguments) -> int:
    handle = ctypes.c_void_p()
    _call(creator, ctypes.byref(handle), *arguments)
    return handle.value


def _destroy_descriptors(library: ctypes.CDLL, handles: list[tuple[str, int]]) -> None:
    while handles:
        destroyer, handle = handles.pop()
        getattr(library, destroyer)(handle)


@functools.cache
def descriptors_for(spec: GemmSpec) -> GemmDescriptors:
    """The descriptors of `spec`, built once per process (they are host objects, valid on any device)."""
    return GemmDescriptors(spec)


# --- running GEMMs (GPU only) ----------------------------------------------------------------------

#: The workspace cuBLASLt may use, allocated once by the device runtime: the size cuBLAS recommends
#: for Hopper. A fixed, preallocated workspace also keeps a GEMM legal inside stream capture (cuBLASLt
#: would otherwise allocate during the call).
WORKSPACE_BYTES = 32 * 1024 * 1024


def _alignment(*byte_quantities: int) -> int:
    """The largest power of two up to 256 dividing every quantity: what cuBLASLt may assume of a matrix."""
    alignment = 256
    for quantity in byte_quantities:
        if quantity:
            alignment = min(alignment, quantity & -quantity)
    return alignment


class CublasLt:
    """cuBLASLt on the current device: a handle, the caller's preallocated workspace, algorithms chosen once.

    Needs a GPU and a current CUDA context (the device runtime's primary context). The heuristic's
    choice is cached per `GemmSpec` and the alignments of the pointers, since the algorithm depends on
    nothing else; `matmul` then costs one host call into cuBLASLt.
    """

    def __init__(self, workspace: int, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.workspace = workspace
        self.workspace_bytes = workspace_bytes
        self.handle = _create("cublasLtCreate")
        self._algorithms: dict[tuple, MatmulHeuristicResult] = {}
        self._finalizer = weakref.finalize(self, cublaslt_library().cublasLtDestroy, self.handle)

    def algorithm(self, spec: GemmSpec, alignments: tuple[int, ...]) -> MatmulHeuristicResult:
        """The heuristic's best algorithm for `spec` with A, B, C, D (cuBLASLt's) and the bias aligned to
        `alignments` bytes; the bias pointer must be set on the descriptors already."""
        key = (spec, alignments)
        found = self._algorithms.get(key)
        if found is None:
            found = self._algorithms[key] = self._query_heuristic(descriptors_for(spec), alignments)
        return found

    def _query_heuristic(self, descriptors: GemmDescriptors, alignments: tuple[int, ...]) -> MatmulHeuristicResult:
        preference = _create("cublasLtMatmulPreferenceCreate")
        try:
            setter = "cublasLtMatmulPreferenceSetAttribute"
            _set(setter, preference, PreferenceAttribute.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, self.workspace_bytes)
            for attribute, alignment in zip((PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                             PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                             PreferenceAttribute.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES),
                                            alignments[:4]):
                _set(setter, preference, attribute, alignment)
            result = MatmulHeuristicResult()
            returned = ctypes.c_int()
            _call("cublasLtMatmulAlgoGetHeuristic", self.handle, descriptors.matmul, descriptors.a, descriptors.b,
                  descriptors.c, descriptors.d, preference, 1, ctypes.byref(result), ctypes.byref(returned))
        finally:
            cublaslt_library().cublasLtMatmulPreferenceDestroy(preference)
        if returned.value == 0:
            raise CublasLtError(f"cublasLtMatmulAlgoGetHeuristic (no algorithm for {descriptors.spec})",
                                Status.CUBLAS_STATUS_NOT_SUPPORTED)
        return result

    def matmul(self, spec: GemmSpec, a: int, b: int, d: int, c: int | None = None, bias: int | None = None,
               alpha: float = 1.0, beta: float = 0.0, stream: int = 0) -> None:
        """Enqueue D = alpha · op(A) @ op(B) + beta · C (+ epilogue) on `stream`; pointers are device addresses.

        C defaults to D (accumulate in place with beta = 1). `bias` is the bias vector read by the
        bias epilogues or the vector the bias-gradient epilogues write.
        """
        descriptors = descriptors_for(spec)
        if (spec.epilogue in BIAS_EPILOGUES) != (bias is not None):
            raise ValueError(f"epilogue {spec.epilogue!r} {'needs' if bias is None else 'takes no'} bias pointer")
        if bias is not None:
            descriptors.set_bias(bias)
        c = d if c is None else c
        in_bytes, out_bytes = ELEMENT_BYTES[spec.dtype], ELEMENT_BYTES[spec.output_dtype]
        batched = spec.batch > 1
        alignments = (  # where each matrix of each batch starts, as PyTorch reckons it (leading dimensions are
            # cuBLASLt's own to check)
            _alignment(b, batched * spec.batch_stride_b * in_bytes),
            _alignment(a, batched * spec.batch_stride_a * in_bytes),
            _alignment(c, batched * spec.batch_stride_c * out_bytes),
            _alignment(d, batched * spec.batch_stride_c * out_bytes),
            _alignment(bias or 0),  # the heuristic reads the bias pointer's alignment from the descriptor
        )
        chosen = self.algorithm(spec, alignments)
        alpha_value, beta_value = ctypes.c_float(alpha), ctypes.c_float(beta)
        # cuBLASLt's A is our B and its B our A (the column-major transpose; see the module's docstring).
        _call("cublasLtMatmul", self.handle, descriptors.matmul, ctypes.byref(alpha_value),
              b, descriptors.a, a, descriptors.b, ctypes.byref(beta_value), c, descriptors.c, d, descriptors.d,
              ctypes.byref(chosen.algo), self.workspace, self.workspace_bytes, stream)

    def close(self) -> None:
        self._finalizer()
