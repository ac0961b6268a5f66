"""Fused attention kernels in the style of FlashAttention-2 (Dao, 2023): `attention_forward`, `attention_backward`.

The public API (a contract the `attention` kern kernel kind binds to):

    attention_forward(head_dim, *, causal, scale, dtype="f32", layout=None, tensor_cores=None) -> KernelProgram
        inputs  q, k, v           storage dtype, placed by `layout`
        outputs o                 storage dtype, placed by `layout`
                lse               f32 [batch, heads, seq] contiguous: log(sum_j exp(scale * q_i . k_j))
                                  over the keys j row i sees (j <= i when causal)
        sizes   batch, heads, seq (runtime: one kernel serves every sequence length)

    attention_backward(head_dim, *, causal, scale, dtype="f32", layout=None, tensor_cores=None) -> KernelProgram
        inputs  q, k, v, o, lse, do
        outputs dq, dk, dv        storage dtype, placed by `layout`
                delta             f32 [batch, heads, seq] contiguous: rowsum(do * o), written by the
                                  first step and read by the others (a scratch the caller allocates
                                  like an output; its value is of no use afterwards)
        sizes   batch, heads, seq

    AttentionLayout: where each of q, k, v, o, do, dq, dk, dv lives (`Placement`s), with two layouts
    made for the compiler: `PACKED` and `HEADS` (the default when `layout` is None).

    tensor_cores: None takes nvcuda::wmma where `tensor_cores_fit(head_dim, dtype)` (bf16 storage, head
    dimensions that are multiples of 16) and plain FMA elsewhere; False asks for FMA; True for wmma (a
    ValueError where it does not fit). The programs' operands are the same either way.

Every pointer operand is bound to the address of the tensor's whole buffer: a
`Placement` gives the element offset of (batch 0, head 0, token 0, feature 0)
within it and the batch, head and token strides in elements (the head-dim
stride is 1), each an integer expression of `seq`, `heads` and `head_dim`
that is compiled into the kernel and evaluated there with the launch's
runtime `seq` and `heads`. So in `PACKED` the operands q, k and v are all
bound to the one [B, T, 3*C] projection (C = heads*head_dim; q at column 0,
k at C, v at 2*C, token stride 3*C, head stride head_dim), o and do to
merged-heads [B, T, C] tensors, and dq, dk and dv all to the one packed
[B, T, 3*C] gradient the projection's backward GEMM reads (each kernel
writes only its own columns). In `HEADS` every tensor is a contiguous
[B, H, T, head_dim]. lse and delta are [B, H, T] in both.

The forward launches one kernel: a block per 64 query rows (tensor cores;
32 with FMA) of one (batch, head), looping over key/value blocks, up to the
diagonal only when causal (the blocks above it are never read, the diagonal
block is masked), with an online softmax (a running maximum and sum per row)
and f32 accumulators; it writes O and the log-sum-exp. The backward launches
three, each deterministic (no atomics; every sum is taken in a fixed order):
`delta` (D = rowsum(dO * O), a warp per row), `dkdv` (a block per key block looping
over the query blocks that see it, recomputing P = exp(S - lse) and
dS = P * (dP - D) and accumulating dV += P^T dO and dK += scale * dS^T Q)
and `dq` (a block per query block looping over the key blocks it sees,
accumulating dQ += scale * dS K). Nothing of size seq x seq is stored: the
score tiles live in shared memory. Head dimensions: multiples of 8 from 8 to
128 (16 to 128 in steps of 16 on the tensor cores). The tensor-core backward
kernels take dynamic shared memory (up to 70 KiB at head dimension 128; the
launch shape says how much). Values are computed in f32 whatever the
storage; each output is rounded once when stored. docs/cuda.md, section "Fused attention", compares this
with FlashAttention-2 and llm.c's cuDNN path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from attrs import frozen

from .kernel_source import (
    FLOAT_STORAGE,
    PACKED_ALIGNMENT,
    KernelParam,
    KernelProgram,
    KernelSource,
    LaunchShape,
    Step,
    check_dtype,
    finish,
    float_literal,
    kernel_head,
    pointer_param,
    size_param,
    vector_width,
)

#: Threads a block for every attention kernel (four warps).
THREADS = 128
#: Head dimensions the kernels take: multiples of this, up to MAX_HEAD_DIM.
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128
#: Rows a warp takes in the `delta` kernel's block: one each.
DELTA_ROWS = THREADS // 32
#: The kernels' name for the operand `do` (a C++ keyword).
DO_PARAMETER = "dout"
#: The names a placement's expressions may use.
LAYOUT_NAMES = ("seq", "heads", "head_dim")
_EXPRESSION = re.compile(r"^[0-9a-z_+*() ]+$")


@frozen
class Placement:
    """Where one [batch, heads, seq, head_dim] tensor lives in its buffer, in elements.

    `offset` is the element index of (0, 0, 0, 0); `batch`, `head` and
    `token` are the strides of those axes (the head-dim stride is 1). Each is
    an integer expression of `seq`, `heads` and `head_dim` using `+`, `*`
    and parentheses, such as "3 * heads * head_dim".
    """

    offset: str
    batch: str
    head: str
    token: str

    def __attrs_post_init__(self) -> None:
        for text in (self.offset, self.batch, self.head, self.token):
            names = set(re.findall(r"[a-z_]+", text))
            if not _EXPRESSION.match(text) or not names <= set(LAYOUT_NAMES):
                raise ValueError(f"attention layout: {text!r} is not an expression of {', '.join(LAYOUT_NAMES)} "
                                 "with + and *")

    def evaluate(self, seq: int, heads: int, head_dim: int) -> tuple[int, int, int, int]:
        """(offset, batch stride, head stride, token stride) for these sizes."""
        names = {"seq": seq, "heads": heads, "head_dim": head_dim}
        return tuple(int(eval(text, {"__builtins__": {}}, names))  # noqa: S307 - checked by _EXPRESSION
                     for text in (self.offset, self.batch, self.head, self.token))

    def c_address(self, pointer: str, row: str) -> str:
        """C for the address of token `row`'s head-dim vector in the kernel's (b, h), as 64-bit arithmetic."""
        def c(text: str) -> str:
            return "(" + re.sub(r"[a-z_]+", lambda m: f"L_{m.group(0)}", text) + ")"
        return (f"{pointer} + {c(self.offset)} + (long long)b * {c(self.batch)} + (long long)h * {c(self.head)}"
                f" + (long long)({row}) * {c(self.token)}")


_PACKED_TOKEN = "3 * heads * head_dim"
_PACKED_BATCH = "seq * 3 * heads * head_dim"
_MERGED = Placement("0", "seq * heads * head_dim", "head_dim", "heads * head_dim")
_CONTIGUOUS = Placement("0", "heads * seq * head_dim", "seq * head_dim", "head_dim")


def _packed(column: str) -> Placement:
    return Placement(column, _PACKED_BATCH, "head_dim", _PACKED_TOKEN)


@frozen
class AttentionLayout:
    """Where the kernels find q, k, v, o and do and write o, dq, dk and dv (see the module docstring)."""

    name: str
    q: Placement
    k: Placement
    v: Placement
    o: Placement
    do: Placement
    dq: Placement
    dk: Placement
    dv: Placement

    def placement(self, operand: str) -> Placement:
        return getattr(self, operand)


#: q, k, v (and dq, dk, dv) in one [B, T, 3*C] buffer at columns 0, C and 2*C; o and do merged-heads [B, T, C].
PACKED = AttentionLayout(
    "packed", _packed("0"), _packed("heads * head_dim"), _packed("2 * heads * head_dim"), _MERGED, _MERGED,
    _packed("0"), _packed("heads * head_dim"), _packed("2 * heads * head_dim"))
#: Every tensor a contiguous [B, H, T, head_dim].
HEADS = AttentionLayout("heads", *(_CONTIGUOUS,) * 8)
LAYOUTS = {"packed": PACKED, "heads": HEADS}


@frozen
class Tiles:
    """A kernel's tile: `rows` rows a block owns (query rows, or key rows in `dkdv`) and `step` rows of the
    other operand it loads per iteration; `lanes` threads share a row."""

    rows: int
    step: int

    @property
    def lanes(self) -> int:
        return THREADS // self.rows


def _tiles(head_dim: int, kernel: str) -> Tiles:
    """Tiles that keep a kernel's shared memory under the 48 KiB a block has without opting in."""
    small = head_dim <= 64
    if kernel == "forward":
        return Tiles(32, 32 if small else 16)
    return Tiles(32, 32) if small else Tiles(16, 16)


def _check(what: str, head_dim: int, dtype: str, scale: float) -> None:
    check_dtype(what, dtype, FLOAT_STORAGE)
    if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{what}: head dimension {head_dim}; the kernels take multiples of {HEAD_DIM_MULTIPLE} "
                         f"up to {MAX_HEAD_DIM}")
    if not scale == scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"{what}: scale {scale} is not finite")


def _sizes() -> tuple[KernelParam, ...]:
    return size_param("batch"), size_param("heads"), size_param("seq")


def _shape(tiles_rows: int, shared_bytes: int = 0) -> Callable[[Mapping[str, int]], LaunchShape]:
    def shape(sizes: Mapping[str, int]) -> LaunchShape:
        return LaunchShape((-(-sizes["seq"] // tiles_rows), sizes["heads"], sizes["batch"]), (THREADS, 1, 1),
                           shared_bytes)
    return shape


def _prologue(head_dim: int, tiles: Tiles) -> str:
    """The constants and indices every attention kernel starts with."""
    return (
        f"    constexpr int D = {head_dim};\n"
        f"    constexpr int ROWS = {tiles.rows};\n"
        f"    constexpr int STEP = {tiles.step};\n"
        f"    constexpr int LANES = {tiles.lanes};\n"
        "    constexpr int DP = D + 1;  // shared rows padded a word: lanes reading a column hit distinct banks\n"
        "    const long long L_seq = seq, L_heads = heads, L_head_dim = D;\n"
        "    const int b = blockIdx.z, h = blockIdx.y;\n"
        "    const int row = threadIdx.x / LANES, part = threadIdx.x % LANES;\n"
        "    const long long stats = ((long long)b * heads + h) * seq;  // lse and delta are [B, H, T]\n")


def _load_tile(tile: str, rows: int, pointer: str, placement: Placement, first: str, vec: int,
               aligned: bool = False) -> str:
    """C that loads `rows` token rows from `first` into the shared tile (zeros past the sequence): an f32 tile
    element by element, or an `aligned` one (rows of the storage type on 16-byte boundaries) a vector at a time."""
    store = (f"        sx_st_vec(&{tile}[r][col], x);\n" if aligned else
             "        #pragma unroll\n"
             f"        for (int j = 0; j < {vec}; ++j) {tile}[r][col + j] = x[j];\n")
    return (
        f"    for (int e = threadIdx.x; e < {rows} * (D / {vec}); e += {THREADS}) {{\n"
        f"        const int r = e / (D / {vec}), col = e % (D / {vec}) * {vec};\n"
        f"        float x[{vec}] = {{}};\n"
        f"        if ({first} + r < seq) sx_ld_vec(x, {placement.c_address(pointer, f'{first} + r')} + col);\n"
        + store + "    }\n")


def _key_steps(end: str, k_tile: str, v_tile: str, rows: int, layout: AttentionLayout, vec: int,
               aligned: bool = False) -> str:
    """C opening the loop over blocks of `rows` keys below `end`, each loaded into the key and value tiles."""
    return (f"    for (int k0 = 0; k0 < {end}; k0 += STEP) {{\n"
            "    __syncthreads();  // every warp is done with the last tiles\n"
            + _load_tile(k_tile, rows, "k", layout.k, "k0", vec, aligned)
            + _load_tile(v_tile, rows, "v", layout.v, "k0", vec, aligned) +
            "    __syncthreads();\n")


def _load_stat(tile: str, rows: int, pointer: str, first: str) -> str:
    return (f"    for (int r = threadIdx.x; r < {rows}; r += {THREADS}) "
            f"{tile}[r] = {first} + r < seq ? {pointer}[stats + {first} + r] : 0.0f;\n")


def _row_reduce(variable: str, combine: str) -> str:
    """C that combines `variable` over the LANES lanes sharing a row (a butterfly: every lane gets the same bits)."""
    return ("    #pragma unroll\n"
            "    for (int offset = LANES / 2; offset > 0; offset >>= 1)\n"
            f"        {variable} = {combine.format(a=variable, b=f'__shfl_xor_sync(SX_FULL_MASK, {variable}, offset)')};\n")


def _store_rows(pointer: str, placement: Placement, first: str, accumulator: str, factor: str) -> str:
    """C that stores this thread's columns of its row of `accumulator` times `factor`, rows past the sequence not."""
    return (
        f"    if ({first} + row < seq) {{\n"
        f"        auto* out = {placement.c_address(pointer, f'{first} + row')};\n"
        "        #pragma unroll\n"
        f"        for (int i = 0; i < D / LANES; ++i) sx_st(out + part + LANES * i, {accumulator}[i] * {factor});\n"
        "    }\n")


def _visible(query: str, key: str, causal: bool) -> str:
    """C for: the key is in the sequence and (causal) not after the query; the query is in the sequence."""
    return f"{query} < seq && {key} < seq" + (f" && {key} <= {query}" if causal else "")


def _forward_params(dtype: str) -> tuple[KernelParam, ...]:
    return (pointer_param("q", dtype, "input", restrict=False), pointer_param("k", dtype, "input", restrict=False),
            pointer_param("v", dtype, "input", restrict=False), pointer_param("o", dtype, "output"),
            pointer_param("lse", "f32", "output"), *_sizes())


def _forward_kernel(head_dim: int, causal: bool, scale: float, dtype: str, layout: AttentionLayout) -> KernelSource:
    tiles = _tiles(head_dim, "forward")
    vec = vector_width(head_dim, [dtype])
    params = _forward_params(dtype)
    end = "min(seq, q0 + ROWS)" if causal else "seq"
    template = (
        kernel_head(THREADS, params) + _prologue(head_dim, tiles) +
        "    __shared__ float q_tile[ROWS][DP], k_tile[STEP][DP], v_tile[STEP][DP], p_tile[ROWS][STEP + 1];\n"
        "    // The last query blocks have the most keys to see when causal: they start first.\n"
        "    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;\n"
        + _load_tile("q_tile", tiles.rows, "q", layout.q, "q0", vec) +
        "    float m = -SX_INF, l = 0.0f, acc[D / LANES] = {};\n"
        + _key_steps(end, "k_tile", "v_tile", tiles.step, layout, vec) +
        "    float s[STEP / LANES] = {};\n"
        "    for (int d = 0; d < D; ++d) {\n"
        "        const float qd = q_tile[row][d];\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < STEP / LANES; ++j) s[j] += qd * k_tile[part + LANES * j][d];\n"
        "    }\n"
        "    float top = -SX_INF;\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / LANES; ++j) {\n"
        "        const int key = k0 + part + LANES * j;\n"
        f"        s[j] = {_visible('q0 + row', 'key', causal)} ? s[j] * {float_literal(scale)} : -SX_INF;\n"
        "        top = fmaxf(top, s[j]);\n"
        "    }\n"
        + _row_reduce("top", "fmaxf({a}, {b})") +
        "    const float m_next = fmaxf(m, top);\n"
        "    // A row that has seen only masked keys keeps m = -inf, l = 0 and adds nothing.\n"
        "    const float rescale = m_next == -SX_INF ? 1.0f : expf(m - m_next);\n"
        "    float added = 0.0f;\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / LANES; ++j) {\n"
        "        const float p = m_next == -SX_INF ? 0.0f : expf(s[j] - m_next);\n"
        "        p_tile[row][part + LANES * j] = p;\n"
        "        added += p;\n"
        "    }\n"
        + _row_reduce("added", "{a} + {b}") +
        "    l = l * rescale + added;\n"
        "    m = m_next;\n"
        "    __syncwarp();  // the row's probabilities are in p_tile (its lanes are one warp's)\n"
        "    #pragma unroll\n"
        "    for (int i = 0; i < D / LANES; ++i) acc[i] *= rescale;\n"
        "    for (int c = 0; c < STEP; ++c) {\n"
        "        const float p = p_tile[row][c];\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < D / LANES; ++i) acc[i] += p * v_tile[c][part + LANES * i];\n"
        "    }\n"
        "    }\n"
        + _store_rows("o", layout.o, "q0", "acc", "(1.0f / l)") +
        "    if (part == 0 && q0 + row < seq) lse[stats + q0 + row] = m + logf(l);\n"
        "}\n")
    name, code = finish(_stem("attention_forward", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_forward", code, params, _shape(tiles.rows), PACKED_ALIGNMENT)


#: The tensor-core forward: query rows a warp takes (wmma's tile side), warps a block, key rows per step.
WMMA_SIDE = 16
WMMA_WARPS = THREADS // 32
WMMA_STEP = 32


def _forward_wmma_kernel(head_dim: int, causal: bool, scale: float, layout: AttentionLayout) -> KernelSource:
    """The bf16 forward with both block products on the tensor cores (nvcuda::wmma, f32 accumulation).

    Each warp owns 16 query rows, their Q fragments loaded once; per step of
    32 keys it makes the 16 x 32 scores (Q K^T, K read as a col_major
    matrix_b), stores them to its shared score tile, and two lanes per row
    update the running maximum and sum and write P in bf16; then P V is made
    a 16-column slice of O at a time and added, through the score tile, into
    the f32 O the lanes hold in registers, each row rescaled by its own
    factor (a wmma accumulator's element-to-row mapping is unspecified, so
    the rescaling cannot be done on the fragment).
    """
    dtype = "bf16"
    vec = vector_width(head_dim, [dtype])
    params = _forward_params(dtype)
    end = "min(seq, q0 + ROWS)" if causal else "seq"
    template = (
        "#include <mma.h>\n" + kernel_head(THREADS, params) +
        f"    constexpr int D = {head_dim};\n"
        f"    constexpr int SIDE = {WMMA_SIDE}, WARPS = {WMMA_WARPS}, STEP = {WMMA_STEP}, ROWS = SIDE * WARPS;\n"
        "    // Padded rows: wmma's ldm is a multiple of 16 bytes, and every fragment starts 32-byte aligned.\n"
        "    constexpr int DK = D + 8, SP = STEP + 4, PP = STEP + 8;\n"
        "    static_assert(ROWS == 2 * STEP, \"the query rows are staged where the key and value rows go\");\n"
        "    __shared__ __align__(32) __nv_bfloat16 kv_tile[2 * STEP][DK];  // keys, then values\n"
        "    __shared__ __align__(32) float s_tile[WARPS][SIDE][SP];\n"
        "    __shared__ __align__(32) __nv_bfloat16 p_tile[WARPS][SIDE][PP];\n"
        "    const long long L_seq = seq, L_heads = heads, L_head_dim = D;\n"
        "    const int b = blockIdx.z, h = blockIdx.y;\n"
        "    const int warp = threadIdx.x / SX_WARP, lane = threadIdx.x % SX_WARP;\n"
        "    const int row = lane / 2, half = lane % 2;  // a lane takes half of one of its warp's rows\n"
        "    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;  // the longest rows first when causal\n"
        "    const int query = q0 + warp * SIDE + row;\n"
        + _load_tile("kv_tile", 2 * WMMA_STEP, "q", layout.q, "q0", vec, aligned=True) +
        "    __syncthreads();\n"
        "    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>"
        " q_frag[D / SIDE];\n"
        "    #pragma unroll\n"
        "    for (int t = 0; t < D / SIDE; ++t) nvcuda::wmma::load_matrix_sync(q_frag[t], &kv_tile[warp * SIDE][t * SIDE]"
        ", DK);\n"
        "    float m = -SX_INF, l = 0.0f, acc[D / 2] = {};  // columns n * 16 + half * 8 + j of the row\n"
        + _key_steps(end, "kv_tile", "(kv_tile + STEP)", WMMA_STEP, layout, vec, aligned=True) +
        "    #pragma unroll\n"
        "    for (int n = 0; n < STEP / SIDE; ++n) {\n"
        "        nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> s_frag;\n"
        "        nvcuda::wmma::fill_fragment(s_frag, 0.0f);\n"
        "        #pragma unroll\n"
        "        for (int t = 0; t < D / SIDE; ++t) {\n"
        "            nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::col_major>"
        " k_frag;\n"
        "            nvcuda::wmma::load_matrix_sync(k_frag, &kv_tile[n * SIDE][t * SIDE], DK);\n"
        "            nvcuda::wmma::mma_sync(s_frag, q_frag[t], k_frag, s_frag);\n"
        "        }\n"
        "        nvcuda::wmma::store_matrix_sync(&s_tile[warp][0][n * SIDE], s_frag, SP, nvcuda::wmma::mem_row_major);\n"
        "    }\n"
        "    __syncwarp();  // the warp's scores are in s_tile\n"
        "    float s[STEP / 2], top = -SX_INF;\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const int key = k0 + half * (STEP / 2) + j;\n"
        f"        s[j] = {_visible('query', 'key', causal)} ? s_tile[warp][row][half * (STEP / 2) + j] * "
        f"{float_literal(scale)} : -SX_INF;\n"
        "        top = fmaxf(top, s[j]);\n"
        "    }\n"
        "    top = fmaxf(top, __shfl_xor_sync(SX_FULL_MASK, top, 1));\n"
        "    const float m_next = fmaxf(m, top);\n"
        "    const float rescale = m_next == -SX_INF ? 1.0f : expf(m - m_next);\n"
        "    float added = 0.0f;\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const float p = m_next == -SX_INF ? 0.0f : expf(s[j] - m_next);\n"
        "        p_tile[warp][row][half * (STEP / 2) + j] = __float2bfloat16_rn(p);\n"
        "        added += p;\n"
        "    }\n"
        "    added += __shfl_xor_sync(SX_FULL_MASK, added, 1);\n"
        "    l = l * rescale + added;\n"
        "    m = m_next;\n"
        "    __syncwarp();  // P is in p_tile, and every lane has read its scores\n"
        "    #pragma unroll\n"
        "    for (int n = 0; n < D / SIDE; ++n) {\n"
        "        nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> o_frag;\n"
        "        nvcuda::wmma::fill_fragment(o_frag, 0.0f);\n"
        "        #pragma unroll\n"
        "        for (int t = 0; t < STEP / SIDE; ++t) {\n"
        "            nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>"
        " p_frag;\n"
        "            nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>"
        " v_frag;\n"
        "            nvcuda::wmma::load_matrix_sync(p_frag, &p_tile[warp][0][t * SIDE], PP);\n"
        "            nvcuda::wmma::load_matrix_sync(v_frag, &kv_tile[STEP + t * SIDE][n * SIDE], DK);\n"
        "            nvcuda::wmma::mma_sync(o_frag, p_frag, v_frag, o_frag);\n"
        "        }\n"
        "        nvcuda::wmma::store_matrix_sync(&s_tile[warp][0][0], o_frag, SP, nvcuda::wmma::mem_row_major);\n"
        "        __syncwarp();\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 8; ++j) acc[n * 8 + j] = acc[n * 8 + j] * rescale + s_tile[warp][row][half * 8 + j];\n"
        "        __syncwarp();  // read before the next slice is stored\n"
        "    }\n"
        "    }\n"
        "    if (query < seq) {\n"
        f"        auto* out = {layout.o.c_address('o', 'query')};\n"
        "        const float inverse = 1.0f / l;\n"
        "        #pragma unroll\n"
        "        for (int n = 0; n < D / SIDE; ++n) {\n"
        "            float x[8];\n"
        "            #pragma unroll\n"
        "            for (int j = 0; j < 8; ++j) x[j] = acc[n * 8 + j] * inverse;\n"
        "            sx_st_vec(out + n * SIDE + half * 8, x);\n"
        "        }\n"
        "        if (half == 0) lse[((long long)b * heads + h) * seq + query] = m + logf(l);\n"
        "    }\n"
        "}\n")
    name, code = finish(_stem("attention_forward_wmma", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_forward", code, params, _shape(WMMA_SIDE * WMMA_WARPS), PACKED_ALIGNMENT)


_A_FRAGMENT = "nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>"
_B_FRAGMENT = "nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>"
_BT_FRAGMENT = "nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::col_major>"
_ACCUMULATOR = "nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>"
#: The dynamic shared memory of the tensor-core backward kernels, carved into tiles.
_SHARED = "sx_attention_shared"


def _wmma_constants(head_dim: int) -> str:
    return (f"    constexpr int D = {head_dim};\n"
            f"    constexpr int SIDE = {WMMA_SIDE}, WARPS = {WMMA_WARPS}, STEP = {WMMA_STEP}, ROWS = SIDE * WARPS;\n"
            "    // Padded rows: wmma's ldm is a multiple of 16 bytes, and every fragment starts 32-byte aligned.\n"
            "    constexpr int DK = D + 8, SP = STEP + 4, PP = STEP + 8;\n"
            "    const long long L_seq = seq, L_heads = heads, L_head_dim = D;\n"
            "    const int b = blockIdx.z, h = blockIdx.y;\n"
            "    const int warp = threadIdx.x / SX_WARP, lane = threadIdx.x % SX_WARP;\n"
            "    const int row = lane / 2, half = lane % 2;  // a lane takes half of one of its warp's 16 rows\n"
            "    const long long stats = ((long long)b * heads + h) * seq;  // lse and delta are [B, H, T]\n")


def _carve(head_dim: int, tiles: Sequence[tuple[str, str, int]]) -> tuple[str, int]:
    """C declaring each (name, kind, rows) tile in the dynamic shared memory, and the bytes they take.

    Kinds: "rows" (bf16 [rows][DK]), "scores" (f32 [WARPS][16][SP]), "probabilities" (bf16 [WARPS][16][PP])
    and "stats" (f32 [rows]); each starts on a 128-byte boundary.
    """
    dk, sp, pp = head_dim + 8, WMMA_STEP + 4, WMMA_STEP + 8
    kinds = {"rows": ("__nv_bfloat16 (*)[DK]", lambda rows: rows * dk * 2),
             "scores": ("float (*)[SIDE][SP]", lambda rows: WMMA_WARPS * WMMA_SIDE * sp * 4),
             "probabilities": ("__nv_bfloat16 (*)[SIDE][PP]", lambda rows: WMMA_WARPS * WMMA_SIDE * pp * 2),
             "stats": ("float*", lambda rows: rows * 4)}
    code = f"    extern __shared__ __align__(128) unsigned char {_SHARED}[];\n"
    offset = 0
    for name, kind, rows in tiles:
        ctype, size = kinds[kind]
        code += f"    const auto {name} = reinterpret_cast<{ctype}>({_SHARED} + {offset});\n"
        offset += -(-size(rows) // 128) * 128
    return code, offset


def _warp_product_t(a: str, b: str, scores: str) -> str:
    """C: the warp's f32 `scores` [16][SP] = its 16 rows of `a` times the STEP rows of `b` transposed (both
    bf16 [.][DK] tiles, over D): b read as a col_major matrix_b."""
    return (
        "    #pragma unroll\n"
        "    for (int n = 0; n < STEP / SIDE; ++n) {\n"
        f"        {_ACCUMULATOR} s_frag;\n"
        "        nvcuda::wmma::fill_fragment(s_frag, 0.0f);\n"
        "        #pragma unroll\n"
        "        for (int t = 0; t < D / SIDE; ++t) {\n"
        f"            {_A_FRAGMENT} a_frag;\n"
        f"            {_BT_FRAGMENT} b_frag;\n"
        f"            nvcuda::wmma::load_matrix_sync(a_frag, &{a}[warp * SIDE][t * SIDE], DK);\n"
        f"            nvcuda::wmma::load_matrix_sync(b_frag, &{b}[n * SIDE][t * SIDE], DK);\n"
        "            nvcuda::wmma::mma_sync(s_frag, a_frag, b_frag, s_frag);\n"
        "        }\n"
        f"        nvcuda::wmma::store_matrix_sync(&{scores}[warp][0][n * SIDE], s_frag, SP, "
        "nvcuda::wmma::mem_row_major);\n"
        "    }\n"
        "    __syncwarp();  // the warp's products are in shared memory\n")


def _warp_accumulate(fragments: str, a: str, b: str) -> str:
    """C: fragments[n] += the warp's bf16 [16][PP] tile `a` (STEP columns) times the STEP rows of `b`
    (bf16 [.][DK]), for each 16-column slice n of the SLICES from column FIRST."""
    return (
        "    #pragma unroll\n"
        "    for (int n = 0; n < SLICES; ++n) {\n"
        "        #pragma unroll\n"
        "        for (int t = 0; t < STEP / SIDE; ++t) {\n"
        f"            {_A_FRAGMENT} a_frag;\n"
        f"            {_B_FRAGMENT} b_frag;\n"
        f"            nvcuda::wmma::load_matrix_sync(a_frag, &{a}[warp][0][t * SIDE], PP);\n"
        f"            nvcuda::wmma::load_matrix_sync(b_frag, &{b}[t * SIDE][FIRST + n * SIDE], DK);\n"
        f"            nvcuda::wmma::mma_sync({fragments}[n], a_frag, b_frag, {fragments}[n]);\n"
        "        }\n"
        "    }\n")


def _store_fragments(fragments: str, scores: str, pointer: str, placement: Placement, token: str,
                     factor: str) -> str:
    """C: the warp's rows of `fragments` (SLICES accumulators, from column FIRST) times `factor` stored to
    token rows `token` (of the lane's row), through the warp's `scores` tile (an accumulator's layout is
    unspecified)."""
    return (
        "    {\n"
        f"    auto* const out = {placement.c_address(pointer, token)};\n"
        "    #pragma unroll\n"
        "    for (int n = 0; n < SLICES; ++n) {\n"
        f"        nvcuda::wmma::store_matrix_sync(&{scores}[warp][0][0], {fragments}[n], SP, "
        "nvcuda::wmma::mem_row_major);\n"
        "        __syncwarp();\n"
        "        float x[8];\n"
        "        #pragma unroll\n"
        f"        for (int j = 0; j < 8; ++j) x[j] = {scores}[warp][row][half * 8 + j] * {factor};\n"
        f"        if ({token} < seq) sx_st_vec(out + FIRST + n * SIDE + half * 8, x);\n"
        "        __syncwarp();  // read before the next slice is stored\n"
        "    }\n"
        "    }\n")


def _zeroed(fragments: str) -> str:
    return (f"    {_ACCUMULATOR} {fragments}[SLICES];\n"
            "    #pragma unroll\n"
            f"    for (int n = 0; n < SLICES; ++n) nvcuda::wmma::fill_fragment({fragments}[n], 0.0f);\n")


#: Head dimensions above this make dK and dV in two passes over the queries, half of the columns each: the
#: accumulators of all of them (D floats a lane) would not fit in registers with the rest.
DKDV_ONE_PASS_HEAD_DIM = 64


def _dkdv_wmma_kernel(head_dim: int, causal: bool, scale: float, layout: AttentionLayout) -> KernelSource:
    """The bf16 dK/dV kernel on the tensor cores: a warp per 16 key rows, a block per 64; per step of 32
    queries S^T = K Q^T and dP^T = V dO^T into the warp's score tile, P^T and dS^T in bf16, then
    dV += P^T dO and dK += dS^T Q into accumulators held for the whole loop (no rescaling is needed)."""
    dtype = "bf16"
    vec = vector_width(head_dim, [dtype])
    params = (*_backward_inputs(dtype), pointer_param("dk", dtype, "output", restrict=False),
              pointer_param("dv", dtype, "output", restrict=False), *_sizes())
    rows, step = WMMA_SIDE * WMMA_WARPS, WMMA_STEP
    carve, shared = _carve(head_dim, [("k_tile", "rows", rows), ("v_tile", "rows", rows), ("q_tile", "rows", step),
                                      ("do_tile", "rows", step), ("s_tile", "scores", 0),
                                      ("p_tile", "probabilities", 0), ("ds_tile", "probabilities", 0),
                                      ("lse_tile", "stats", step), ("delta_tile", "stats", step)])
    start = "k0 / STEP * STEP" if causal else "0"
    passes = 1 if head_dim <= DKDV_ONE_PASS_HEAD_DIM else 2
    template = (
        "#include <mma.h>\n" + kernel_head(THREADS, params) + _wmma_constants(head_dim) + carve +
        f"    constexpr int PASSES = {passes}, SLICES = D / SIDE / PASSES;\n"
        "    const int k0 = blockIdx.x * ROWS;  // the first key blocks see the most queries when causal\n"
        "    const int key = k0 + warp * SIDE + row;\n"
        + _load_tile("k_tile", rows, "k", layout.k, "k0", vec, aligned=True)
        + _load_tile("v_tile", rows, "v", layout.v, "k0", vec, aligned=True) +
        "    for (int pass = 0; pass < PASSES; ++pass) {\n"
        "    const int FIRST = pass * (D / PASSES);  // the columns of dK and dV this pass makes\n"
        + _zeroed("dk_frag") + _zeroed("dv_frag") +
        f"    for (int q0 = {start}; q0 < seq; q0 += STEP) {{\n"
        "    __syncthreads();  // every warp is done with the last query tiles\n"
        + _load_tile("q_tile", step, "q", layout.q, "q0", vec, aligned=True)
        + _load_tile("do_tile", step, DO_PARAMETER, layout.do, "q0", vec, aligned=True)
        + _load_stat("lse_tile", step, "lse", "q0") + _load_stat("delta_tile", step, "delta", "q0") +
        "    __syncthreads();\n"
        + _warp_product_t("k_tile", "q_tile", "s_tile") +
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const int c = half * (STEP / 2) + j;\n"
        f"        const float p = {_visible('q0 + c', 'key', causal)} ? "
        f"expf(s_tile[warp][row][c] * {float_literal(scale)} - lse_tile[c]) : 0.0f;\n"
        "        p_tile[warp][row][c] = __float2bfloat16_rn(p);\n"
        "    }\n"
        "    __syncwarp();  // every lane has read its scores\n"
        + _warp_product_t("v_tile", "do_tile", "s_tile") +
        "    // P is read back as rounded for dV: the dK/dV accumulators leave no registers to keep it in f32.\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const int c = half * (STEP / 2) + j;\n"
        "        ds_tile[warp][row][c] = __float2bfloat16_rn(__bfloat162float(p_tile[warp][row][c]) *\n"
        "                                                    (s_tile[warp][row][c] - delta_tile[c]));\n"
        "    }\n"
        "    __syncwarp();  // P^T and dS^T are in shared memory\n"
        + _warp_accumulate("dv_frag", "p_tile", "do_tile") + _warp_accumulate("dk_frag", "ds_tile", "q_tile") +
        "    }\n"
        + _store_fragments("dk_frag", "s_tile", "dk", layout.dk, "key", float_literal(scale))
        + _store_fragments("dv_frag", "s_tile", "dv", layout.dv, "key", "1.0f") +
        "    }\n"
        "}\n")
    name, code = finish(_stem("attention_dkdv_wmma", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_dkdv", code, params, _shape(rows, shared), PACKED_ALIGNMENT)


def _dq_wmma_kernel(head_dim: int, causal: bool, scale: float, layout: AttentionLayout) -> KernelSource:
    """The bf16 dQ kernel on the tensor cores: a warp per 16 query rows, a block per 64; per step of 32 keys
    S = Q K^T and dP = dO V^T into the warp's score tile, dS in bf16, then dQ += dS K into accumulators
    held for the whole loop."""
    dtype = "bf16"
    vec = vector_width(head_dim, [dtype])
    params = (*_backward_inputs(dtype), pointer_param("dq", dtype, "output", restrict=False), *_sizes())
    rows, step = WMMA_SIDE * WMMA_WARPS, WMMA_STEP
    carve, shared = _carve(head_dim, [("q_tile", "rows", rows), ("do_tile", "rows", rows), ("k_tile", "rows", step),
                                      ("v_tile", "rows", step), ("s_tile", "scores", 0),
                                      ("ds_tile", "probabilities", 0)])
    end = "min(seq, q0 + ROWS)" if causal else "seq"
    template = (
        "#include <mma.h>\n" + kernel_head(THREADS, params) + _wmma_constants(head_dim) + carve +
        "    constexpr int SLICES = D / SIDE, FIRST = 0;\n"
        "    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;  // the longest rows first when causal\n"
        "    const int query = q0 + warp * SIDE + row;\n"
        + _load_tile("q_tile", rows, "q", layout.q, "q0", vec, aligned=True)
        + _load_tile("do_tile", rows, DO_PARAMETER, layout.do, "q0", vec, aligned=True) +
        "    const float row_lse = query < seq ? lse[stats + query] : 0.0f;\n"
        "    const float row_delta = query < seq ? delta[stats + query] : 0.0f;\n"
        + _zeroed("dq_frag")
        + _key_steps(end, "k_tile", "v_tile", step, layout, vec, aligned=True)
        + _warp_product_t("q_tile", "k_tile", "s_tile") +
        "    float p[STEP / 2];\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const int c = half * (STEP / 2) + j;\n"
        f"        p[j] = {_visible('query', 'k0 + c', causal)} ? expf(s_tile[warp][row][c] * {float_literal(scale)}"
        " - row_lse) : 0.0f;\n"
        "    }\n"
        "    __syncwarp();  // every lane has read its scores\n"
        + _warp_product_t("do_tile", "v_tile", "s_tile") +
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / 2; ++j) {\n"
        "        const int c = half * (STEP / 2) + j;\n"
        "        ds_tile[warp][row][c] = __float2bfloat16_rn(p[j] * (s_tile[warp][row][c] - row_delta));\n"
        "    }\n"
        "    __syncwarp();  // dS is in shared memory\n"
        + _warp_accumulate("dq_frag", "ds_tile", "k_tile") +
        "    }\n"
        + _store_fragments("dq_frag", "s_tile", "dq", layout.dq, "query", float_literal(scale)) +
        "}\n")
    name, code = finish(_stem("attention_dq_wmma", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_dq", code, params, _shape(rows, shared), PACKED_ALIGNMENT)


def _delta_kernel(head_dim: int, dtype: str, layout: AttentionLayout) -> KernelSource:
    params = (pointer_param("o", dtype, "input"), pointer_param(DO_PARAMETER, dtype, "input"),
              pointer_param("delta", "f32", "output"), *_sizes())
    template = (
        kernel_head(THREADS, params) +
        f"    constexpr int D = {head_dim};\n"
        "    const long long L_seq = seq, L_heads = heads, L_head_dim = D;\n"
        "    const int b = blockIdx.z, h = blockIdx.y;\n"
        f"    const int token = blockIdx.x * {DELTA_ROWS} + threadIdx.x / SX_WARP, lane = threadIdx.x % SX_WARP;\n"
        "    if (token >= seq) return;  // whole warps leave: the warp sum below has all its lanes\n"
        f"    const auto* o_row = {layout.o.c_address('o', 'token')};\n"
        f"    const auto* do_row = {layout.do.c_address(DO_PARAMETER, 'token')};\n"
        "    float dot = 0.0f;\n"
        "    for (int d = lane; d < D; d += SX_WARP) dot += sx_ld(o_row + d) * sx_ld(do_row + d);\n"
        "    dot = sx_warp_sum(dot);\n"
        "    if (lane == 0) delta[((long long)b * heads + h) * seq + token] = dot;\n"
        "}\n")
    name, code = finish(f"attention_delta_{_LETTERS[dtype]}_d{head_dim}_{layout.name}", template)
    return KernelSource(name, "attention_delta", code, params, _shape(DELTA_ROWS), 4)


def _backward_inputs(dtype: str) -> tuple[KernelParam, ...]:
    data = [pointer_param(n, dtype, "input", restrict=False) for n in ("q", "k", "v")]
    stats = [pointer_param("lse", "f32", "input"), pointer_param(DO_PARAMETER, dtype, "input"),
             pointer_param("delta", "f32", "input")]
    return (*data, *stats)


def _row_probabilities(rows: tuple[str, str], columns: tuple[str, str], *, query: str, key: str, lse: str,
                       delta: str, causal: bool, scale: float, kept: str | None = None) -> str:
    """C for the backward's inner step of the FMA kernels: this thread's row of the block's own tiles `rows`
    (scores side, dP side) against STEP rows of the iteration's tiles `columns`, S = rows[0] . columns[0] and
    dP = rows[1] . columns[1], then P = exp(scale * S - lse) and dS = P * (dP - delta) where the (query, key)
    pair is visible, written to `ds_tile[row][col]` (and P to `kept[row][col]`). `dkdv` owns key rows
    against query tiles, `dq` query rows against key tiles: `query`, `key`, `lse` and `delta` are C of the
    column `col` (the other operand's row) or of the thread's `row`."""
    own_s, own_dp = rows
    other_s, other_dp = columns
    keep = f"        {kept}[row][col] = p;\n" if kept is not None else ""
    return (
        "    float s[STEP / LANES] = {}, dp[STEP / LANES] = {};\n"
        "    for (int d = 0; d < D; ++d) {\n"
        f"        const float sd = {own_s}[row][d], dpd = {own_dp}[row][d];\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < STEP / LANES; ++j) {\n"
        f"            s[j] += sd * {other_s}[part + LANES * j][d];\n"
        f"            dp[j] += dpd * {other_dp}[part + LANES * j][d];\n"
        "        }\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < STEP / LANES; ++j) {\n"
        "        const int col = part + LANES * j;\n"
        f"        const bool visible = {_visible(query, key, causal)};\n"
        f"        const float p = visible ? expf(s[j] * {float_literal(scale)} - {lse}) : 0.0f;\n"
        + keep +
        f"        ds_tile[row][col] = visible ? p * (dp[j] - {delta}) : 0.0f;\n"
        "    }\n"
        "    __syncwarp();  // the row's dS (and P) are in shared memory (its lanes are one warp's)\n")


def _dkdv_kernel(head_dim: int, causal: bool, scale: float, dtype: str, layout: AttentionLayout) -> KernelSource:
    """A block per key block: dV = sum over query blocks of P^T dO, dK = scale * sum of dS^T Q."""
    tiles = _tiles(head_dim, "backward")
    vec = vector_width(head_dim, [dtype])
    params = (*_backward_inputs(dtype), pointer_param("dk", dtype, "output", restrict=False),
              pointer_param("dv", dtype, "output", restrict=False), *_sizes())
    start = "k0 / STEP * STEP" if causal else "0"
    template = (
        kernel_head(THREADS, params) + _prologue(head_dim, tiles) +
        "    __shared__ float k_tile[ROWS][DP], v_tile[ROWS][DP], q_tile[STEP][DP], do_tile[STEP][DP];\n"
        "    __shared__ float p_tile[ROWS][STEP + 1], ds_tile[ROWS][STEP + 1], lse_tile[STEP], delta_tile[STEP];\n"
        "    const int k0 = blockIdx.x * ROWS;  // the first key blocks see the most queries when causal\n"
        + _load_tile("k_tile", tiles.rows, "k", layout.k, "k0", vec)
        + _load_tile("v_tile", tiles.rows, "v", layout.v, "k0", vec) +
        "    float dk_sum[D / LANES] = {}, dv_sum[D / LANES] = {};\n"
        f"    for (int q0 = {start}; q0 < seq; q0 += STEP) {{\n"
        "    __syncthreads();  // every warp is done with the last query tiles\n"
        + _load_tile("q_tile", tiles.step, "q", layout.q, "q0", vec)
        + _load_tile("do_tile", tiles.step, DO_PARAMETER, layout.do, "q0", vec)
        + _load_stat("lse_tile", tiles.step, "lse", "q0") + _load_stat("delta_tile", tiles.step, "delta", "q0") +
        "    __syncthreads();\n"
        + _row_probabilities(("k_tile", "v_tile"), ("q_tile", "do_tile"), query="q0 + col", key="k0 + row",
                             lse="lse_tile[col]", delta="delta_tile[col]", causal=causal, scale=scale,
                             kept="p_tile") +
        "    for (int r = 0; r < STEP; ++r) {\n"
        "        const float p = p_tile[row][r], ds = ds_tile[row][r];\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < D / LANES; ++i) {\n"
        "            dv_sum[i] += p * do_tile[r][part + LANES * i];\n"
        "            dk_sum[i] += ds * q_tile[r][part + LANES * i];\n"
        "        }\n"
        "    }\n"
        "    }\n"
        + _store_rows("dk", layout.dk, "k0", "dk_sum", float_literal(scale))
        + _store_rows("dv", layout.dv, "k0", "dv_sum", "1.0f") +
        "}\n")
    name, code = finish(_stem("attention_dkdv", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_dkdv", code, params, _shape(tiles.rows), PACKED_ALIGNMENT)


def _dq_kernel(head_dim: int, causal: bool, scale: float, dtype: str, layout: AttentionLayout) -> KernelSource:
    """A block per query block: dQ = scale * sum over the key blocks it sees of dS K."""
    tiles = _tiles(head_dim, "backward")
    vec = vector_width(head_dim, [dtype])
    params = (*_backward_inputs(dtype), pointer_param("dq", dtype, "output", restrict=False), *_sizes())
    end = "min(seq, q0 + ROWS)" if causal else "seq"
    template = (
        kernel_head(THREADS, params) + _prologue(head_dim, tiles) +
        "    __shared__ float q_tile[ROWS][DP], do_tile[ROWS][DP], k_tile[STEP][DP], v_tile[STEP][DP];\n"
        "    __shared__ float ds_tile[ROWS][STEP + 1];\n"
        "    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;\n"
        + _load_tile("q_tile", tiles.rows, "q", layout.q, "q0", vec)
        + _load_tile("do_tile", tiles.rows, DO_PARAMETER, layout.do, "q0", vec) +
        "    const float row_lse = q0 + row < seq ? lse[stats + q0 + row] : 0.0f;\n"
        "    const float row_delta = q0 + row < seq ? delta[stats + q0 + row] : 0.0f;\n"
        "    float dq_sum[D / LANES] = {};\n"
        + _key_steps(end, "k_tile", "v_tile", tiles.step, layout, vec)
        + _row_probabilities(("q_tile", "do_tile"), ("k_tile", "v_tile"), query="q0 + row", key="k0 + col",
                             lse="row_lse", delta="row_delta", causal=causal, scale=scale) +
        "    for (int c = 0; c < STEP; ++c) {\n"
        "        const float ds = ds_tile[row][c];\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < D / LANES; ++i) dq_sum[i] += ds * k_tile[c][part + LANES * i];\n"
        "    }\n"
        "    }\n"
        + _store_rows("dq", layout.dq, "q0", "dq_sum", float_literal(scale)) +
        "}\n")
    name, code = finish(_stem("attention_dq", head_dim, causal, scale, dtype, layout), template)
    return KernelSource(name, "attention_dq", code, params, _shape(tiles.rows), PACKED_ALIGNMENT)


_LETTERS = {"f32": "f", "bf16": "b"}


def _stem(family: str, head_dim: int, causal: bool, scale: float, dtype: str, layout: AttentionLayout) -> str:
    return f"{family}_{_LETTERS[dtype]}_d{head_dim}_{'causal' if causal else 'full'}_scale{scale:g}_{layout.name}"


def tensor_cores_fit(head_dim: int, dtype: str) -> bool:
    """Whether the tensor-core (wmma) kernels take this head dimension and storage: bf16, multiples of 16."""
    return dtype == "bf16" and head_dim % WMMA_SIDE == 0


def _tensor_cores_chosen(what: str, head_dim: int, dtype: str, tensor_cores: bool | None) -> bool:
    fits = tensor_cores_fit(head_dim, dtype)
    if tensor_cores and not fits:
        raise ValueError(f"{what}: the tensor-core kernels take bf16 storage and head dimensions that are "
                         f"multiples of {WMMA_SIDE}, not {dtype} and {head_dim}")
    return fits and tensor_cores is not False


def attention_forward(head_dim: int, *, causal: bool, scale: float, dtype: str = "f32",
                      layout: AttentionLayout | None = None, tensor_cores: bool | None = None) -> KernelProgram:
    """O = softmax(scale * Q K^T, masked above the diagonal when `causal`) V and its rows' log-sum-exp (see the
    module docstring for the operands and how they bind).

    `tensor_cores` chooses the wmma kernel (True) or the plain FMA one (False);
    None takes the tensor cores where they fit (`tensor_cores_fit`).
    """
    _check("attention_forward", head_dim, dtype, scale)
    layout = layout or HEADS
    if _tensor_cores_chosen("attention_forward", head_dim, dtype, tensor_cores):
        kernel = _forward_wmma_kernel(head_dim, causal, scale, layout)
    else:
        kernel = _forward_kernel(head_dim, causal, scale, dtype, layout)
    return KernelProgram("attention_forward", kernel.params, (Step(kernel, tuple(p.name for p in kernel.params)),))


def attention_backward(head_dim: int, *, causal: bool, scale: float, dtype: str = "f32",
                       layout: AttentionLayout | None = None, tensor_cores: bool | None = None) -> KernelProgram:
    """dQ, dK and dV of the attention from Q, K, V, O, the forward's log-sum-exp and dO, in three launches:
    delta = rowsum(dO * O), then dK and dV per key block, then dQ per query block (`tensor_cores` as for
    `attention_forward`)."""
    _check("attention_backward", head_dim, dtype, scale)
    layout = layout or HEADS
    fits = _tensor_cores_chosen("attention_backward", head_dim, dtype, tensor_cores)
    delta = _delta_kernel(head_dim, dtype, layout)
    if fits:
        dkdv, dq = _dkdv_wmma_kernel(head_dim, causal, scale, layout), _dq_wmma_kernel(head_dim, causal, scale, layout)
    else:
        dkdv = _dkdv_kernel(head_dim, causal, scale, dtype, layout)
        dq = _dq_kernel(head_dim, causal, scale, dtype, layout)
    params = (*(pointer_param(n, dtype, "input") for n in ("q", "k", "v", "o")), pointer_param("lse", "f32", "input"),
              pointer_param("do", dtype, "input"), *(pointer_param(n, dtype, "output") for n in ("dq", "dk", "dv")),
              pointer_param("delta", "f32", "output"), *_sizes())
    steps = tuple(Step(kernel, tuple("do" if p.name == DO_PARAMETER else p.name for p in kernel.params))
                  for kernel in (delta, dkdv, dq))
    return KernelProgram("attention_backward", params, steps)
