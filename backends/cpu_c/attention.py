"""C for the `attention` kernels: causal or full `softmax(scale·Q·Kᵀ)·V` and its backward, one head a task.

The kernels `match-patterns` makes of an attention region for the `cpu-c` target (`passes/patterns/
attention.py`, `target.py`): the forward writes O and the log-sum-exp of each query row's scores (`lse`, f32
[batch, heads, seq]); the backward is one step, dQ, dK and dV from Q, K, V, O, dO and lse, recomputing the
probabilities P = exp(scale·q·k − lse) from Q and K block by block, so nothing of size seq × seq is kept
(the GPU's three steps split it where a block does not hold a whole head). Every operand is read or
written where its `placements` entry says ([offset, batch stride, head stride, token stride] in elements of
the buffer it is bound to; the head-dim stride is 1): Q, K and V are three column ranges of one packed
projection, O and the gradients merged heads (or contiguous heads where the graph does not merge them).

On a CPU one (batch, head) is one iteration of an OpenMP loop (static schedule; each thread allocates one
scratch block for its iterations), FlashAttention-2's structure without its tiles in shared memory: the
head's K and V are transposed into f32 scratch ([head_dim][seq], zero-padded to a multiple of 8 keys; f32 by
8 × 8 blocks in vector registers), Q, dO, V, K and O rows are read in place where they are f32 (widened into
scratch where they are bf16), then blocks of `QUERY_BLOCK` query rows go through one product microkernel
(`sx_att_product` in `ATTENTION_PRELUDE`: tiles of `TILE_SUMS` vectors of sums in registers, 16-lane vectors
first where the host has AVX-512, multiply-adds fused where the host has FMA): the scores Q·Kᵀ and dP = dO·Vᵀ
of a block (keys in vectors), its probabilities from the row's maximum and sum (the forward) or the saved
log-sum-exp (the backward), then
P·V, or dV += Pᵀ·dO, dK += dSᵀ·Q and the block's dQ = dS·K. A block reads the keys up to its last row's
(rounded up to a vector) and masks the rest, so causal attention skips the key blocks above the diagonal;
its rows past the sequence repeat the last one and are never stored. Every sum runs in an order set by the
sizes alone (over the head dimension, keys or a block's rows in ascending order, onto dK and dV block after
block; a row's maximum and sum over 8 lanes in a fixed tree) within one task, so the results do not depend
on the thread count; all math is f32 and each output is rounded once when stored.
"""

from __future__ import annotations

from ...dialects.core import Operation
from .kernels import PARALLEL_FROM, STORAGE, UnsupportedKernel, float_literal, load, store

#: Query rows handled together (a multiple of `TILE_SUMS`, and of `VECTOR`, so a block's score rows are
#: whole vectors of keys and the zero padding of a transposed head to a vector covers the last block).
QUERY_BLOCK = 8
#: f32 lanes of the microkernels' vectors (an AVX2 register; GCC's and Clang's vector extensions lower
#: them to whatever the host has). Head dimensions are multiples of it (the attention targets take those).
VECTOR = 8
#: Vectors of sums in a register tile of `sx_att_product`: 8 of the 16 AVX2 registers, 8 independent
#: multiply-add chains (enough to cover an FMA's latency on both pipes); a multiply-add costs 3/4 of a load
#: (a vector of the other operand or a row's broadcast) in a 2 × 4 or 4 × 2 tile, 9/8 in an 8 × 1 one.
TILE_SUMS = 8
#: Tile widths in vectors, widest first: a row of sums goes through the widest tiles that fit, then the
#: narrower ones, each `TILE_SUMS // width` rows tall, so every tile has all its chains. 2 rows × 4 vectors
#: measured 10-15% faster than 4 × 2 on the attention kernels of tiny-gpt (head dimension 32: one tile
#: spans a row of O, dQ, dK or dV).
TILE_WIDTHS = (4, 2, 1)
#: Where the host has AVX-512 (and FMA), the columns go first through tiles of 16-lane vectors (4 rows × 2
#: vectors, then 8 × 1: 8 sums each), the rest through the 8-lane ones: a core with two 512-bit FMA pipes
#: (Intel's) multiplies twice as many lanes an instruction. Each sum is the same chain of fused multiply-adds
#: in order of k in either width, so the results do not depend on which tiles a column falls in.
WIDE_VECTOR = 16
WIDE_TILE_WIDTHS = (2, 1)


def _tile(vectors: int, lanes: int = VECTOR) -> str:
    """C of one register tile of `sx_att_product`: `TILE_SUMS // vectors` rows from m0 by `vectors` vectors
    of `lanes` f32 from n0, summed over k in order, each sum in a register."""
    rows = range(TILE_SUMS // vectors)
    cells = [(r, v) for r in rows for v in range(vectors)]
    vector = f"sx_v{lanes}"
    at = "c + (m0 + {r}) * ldc + n0 + {o}"
    return ("".join(f"            const float* a{r} = a + sx_imin(m0 + {r}, rows - 1) * am;\n" for r in rows)
            + "".join(f"            {vector} c{r}{v} = accumulate ? *(const {vector}*)({at.format(r=r, o=v * lanes)}) "
                      f": ({vector}){{0}};\n" for r, v in cells)
            + "            for (long long k = 0; k < K; ++k) {\n"
            + "".join(f"                const {vector} b{v} = *(const {vector}*)(b + k * ldb + n0 + {v * lanes});\n"
                      for v in range(vectors))
            + "".join(f"                const {vector} a{r}k = sx_splat{lanes}(a{r}[k * ak]);\n"
                      + "".join(f"                c{r}{v} = sx_fma{lanes}(a{r}k, b{v}, c{r}{v});\n" for v in range(vectors))
                      for r in rows)
            + "            }\n"
            + "".join(f"            *({vector}*)({at.format(r=r, o=v * lanes)}) = c{r}{v};\n" for r, v in cells))


def _tiles(widths: tuple[int, ...], lanes: int) -> str:
    """The loops of `sx_att_product` over the columns left from n0 in tiles of `widths` vectors of `lanes`."""
    return "".join(f"    for (; n0 + {width * lanes} <= N; n0 += {width * lanes})\n"
                   f"        for (long long m0 = 0; m0 < M; m0 += {TILE_SUMS // width}) {{\n{_tile(width, lanes)}        }}\n"
                   for width in widths)


#: The microkernels of every attention kernel, at the start of each unit of kernels (`render.py`).
#: `sx_att_product`, c[m][n] (+)= sum over k < K of a[m·am + k·ak] · b[k·ldb + n] for m < M (a multiple of
#: TILE_SUMS) and n < N (a multiple of VECTOR), each sum in order of k: rows of a from `rows` on read row
#: rows - 1 (their results are not used), so a head is read in place without padding; the strides make it
#: the scores Q·Kᵀ (K transposed), P·V, dS·K, Pᵀ·dO and dSᵀ·Q. Multiply-adds fused where the host has FMA
#: (`sx_fma8`, `sx_fma16`; the kernels' other math stays unfused, `-ffp-contract=off`), a multiply and an add
#: elsewhere; 16-lane tiles first where the host has AVX-512 (`WIDE_VECTOR`).
#: `sx_att_transpose8`: an 8 × 8 block transposed (AVX shuffles where the host has AVX); `sx_att_softmax_row`:
#: a score row's maximum and exp(x - max), vectorized; `sx_att_dot`: a row sum D = dO·O.
ATTENTION_PRELUDE = (r"""
/* The vector helpers are always inlined, so no call passes a vector (GCC warns, at the end of the unit, where
   the host has no AVX). */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float sx_v8 __attribute__((vector_size(32), aligned(4), __may_alias__));
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__FMA__) && defined(__AVX__)
static inline __attribute__((always_inline)) sx_v8 sx_fma8(sx_v8 a, sx_v8 b, sx_v8 c) {
    return (sx_v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline __attribute__((always_inline)) sx_v8 sx_fma8(sx_v8 a, sx_v8 b, sx_v8 c) { return a * b + c; }
#endif
static inline __attribute__((always_inline)) sx_v8 sx_splat8(float x) { return (sx_v8){x, x, x, x, x, x, x, x}; }
#if defined(__AVX512F__) && defined(__FMA__)
#define SX_ATT_WIDE 1
typedef float sx_v16 __attribute__((vector_size(64), aligned(4), __may_alias__));
static inline __attribute__((always_inline)) sx_v16 sx_fma16(sx_v16 a, sx_v16 b, sx_v16 c) {
    return (sx_v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline __attribute__((always_inline)) sx_v16 sx_splat16(float x) { return (sx_v16)_mm512_set1_ps(x); }
#endif
static inline __attribute__((always_inline)) void sx_att_product(long long M, long long N, long long K, long long rows,
                                                                const float* a, long long am, long long ak,
                                                                const float* b, long long ldb,
                                                                float* c, long long ldc, int accumulate) {
    long long n0 = 0;
#if defined(SX_ATT_WIDE)
""" + _tiles(WIDE_TILE_WIDTHS, WIDE_VECTOR) + "#endif\n" + _tiles(TILE_WIDTHS, VECTOR) + r"""}
/* dst[j * ldd + i] = src[i * lds + j] for i, j < 8. */
static inline __attribute__((always_inline)) void sx_att_transpose8(const float* src, long long lds, float* dst, long long ldd) {
#if defined(__AVX__)
    const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds), r2 = _mm256_loadu_ps(src + 2 * lds),
                 r3 = _mm256_loadu_ps(src + 3 * lds), r4 = _mm256_loadu_ps(src + 4 * lds),
                 r5 = _mm256_loadu_ps(src + 5 * lds), r6 = _mm256_loadu_ps(src + 6 * lds),
                 r7 = _mm256_loadu_ps(src + 7 * lds);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
#else
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}
/* Lane 0 of the maximum (NaN-propagating, as sx_fmax) or the sum of a vector's 8 lanes in a fixed tree:
   lane l with l + 4, then l + 2, then l + 1, by shuffles (a scalar tree of sx_fmax branches on every pair). */
typedef int sx_i8 __attribute__((vector_size(32)));
#if defined(__clang__) || __GNUC__ >= 12
#define SX_SHUFFLE8(v, a, b, c, d, e, f, g, h) __builtin_shufflevector(v, v, a, b, c, d, e, f, g, h)
#else
#define SX_SHUFFLE8(v, a, b, c, d, e, f, g, h) __builtin_shuffle(v, (sx_i8){a, b, c, d, e, f, g, h})
#endif
static inline __attribute__((always_inline)) sx_v8 sx_vmax8(sx_v8 a, sx_v8 b) {
    const sx_i8 larger = (a > b) | (a != a);
    return (sx_v8)(((sx_i8)a & larger) | ((sx_i8)b & ~larger));
}
static inline __attribute__((always_inline)) float sx_att_fold_max8(sx_v8 x) {
    x = sx_vmax8(x, SX_SHUFFLE8(x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = sx_vmax8(x, SX_SHUFFLE8(x, 2, 3, 0, 1, 6, 7, 4, 5));
    return sx_vmax8(x, SX_SHUFFLE8(x, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
static inline __attribute__((always_inline)) float sx_att_fold_sum8(sx_v8 x) {
    x += SX_SHUFFLE8(x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += SX_SHUFFLE8(x, 2, 3, 0, 1, 6, 7, 4, 5);
    return (x + SX_SHUFFLE8(x, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
/* A score row's maximum m and the sum of exp(x - m), each over 8 lanes of vectors folded as above; x[j]
   becomes exp(x[j] - m). */
static inline __attribute__((always_inline)) float sx_att_softmax_row(float* x, long long span, float* sum) {
    sx_v8 top = (sx_v8){0} - INFINITY, total = {0};
    for (long long j = 0; j < span; j += 8) top = sx_vmax8(*(const sx_v8*)(x + j), top);
    const float m = sx_att_fold_max8(top);
    #pragma omp simd
    for (long long j = 0; j < span; ++j) x[j] = sx_expf(x[j] - m);
    for (long long j = 0; j < span; j += 8) total += *(const sx_v8*)(x + j);
    *sum = sx_att_fold_sum8(total);
    return m;
}
/* The dot product of two f32 rows of n elements (a multiple of 8), in 8 lanes folded as above. */
static inline __attribute__((always_inline)) float sx_att_dot(const float* a, const float* b, long long n) {
    sx_v8 total = {0};
    for (long long j = 0; j < n; j += 8) total = sx_fma8(*(const sx_v8*)(a + j), *(const sx_v8*)(b + j), total);
    return sx_att_fold_sum8(total);
}
""")


class AttentionKernel:
    """The body of one attention kernel's C function (a forward or a backward)."""

    def __init__(self, kernel: Operation) -> None:
        attrs = kernel.attributes
        self.symbol = attrs["sym_name"]
        names = list(attrs["operands"])
        types = [*attrs["inputs"], *attrs["outputs"]]
        #: operand name -> its dtype; its pointer is `a_<name>` (`do` is a C keyword).
        self.dtypes = {name: t.dtype for name, t in zip(names, types)}
        inputs = len(attrs["inputs"])
        self.head = "".join(
            f"    {'const ' if k < inputs else ''}{STORAGE[t.dtype]}* a_{name} = {'in' if k < inputs else 'out'}"
            f"{k if k < inputs else k - inputs};\n" for k, (name, t) in enumerate(zip(names, types)))
        sizes = attrs["sizes"]
        self.heads, self.seq, self.head_dim = int(sizes["heads"]), int(sizes["seq"]), int(attrs["head_dim"])
        self.tasks = int(sizes["batch"]) * self.heads
        self.causal = bool(attrs["causal"])
        self.scale = float_literal(attrs["scale"])
        self.placements = {name: self._numbers(name, place) for name, place in attrs["placements"].items()}
        self.direction = attrs["direction"]
        if self.head_dim % VECTOR:
            raise UnsupportedKernel(f"kernel {self.symbol}: head dimension {self.head_dim} is not a multiple of {VECTOR}")
        #: The sequence rounded up to a vector: a head's transposed rows and its score rows are this long.
        self.padded = -(-self.seq // VECTOR) * VECTOR

    def _numbers(self, name: str, place: list[str]) -> tuple[int, ...]:
        try:
            return tuple(int(text) for text in place)
        except ValueError:
            raise UnsupportedKernel(f"kernel {self.symbol}: the placement of {name} is not numeric: {place}") from None

    def code(self) -> str:
        scratch, body = self._forward() if self.direction == "forward" else self._backward()
        T, D = self.seq, self.head_dim
        work = self.tasks * T * T * D
        # One scratch block a thread (not one a task), its arrays 64-byte aligned.
        sizes = [-(-count // 16) * 16 for _, count in scratch]
        carve = "".join(f"        float* {name} = sx_scratch + {sum(sizes[:k])}LL;\n"
                        for k, (name, _) in enumerate(scratch))
        return (self.head
                + f"    #pragma omp parallel if({work} >= {PARALLEL_FROM})\n"
                + "    {\n"
                + (f"        float* sx_scratch = (float*)aligned_alloc(64, {sum(sizes)}LL * sizeof(float));\n{carve}"
                   if scratch else "")
                + "        #pragma omp for schedule(static)\n"
                + f"        for (long long task = 0; task < {self.tasks}LL; ++task) {{\n"
                + f"            const long long b = task / {self.heads}LL, h = task % {self.heads}LL;\n"
                + "".join(f"            const long long {name}0 = {self._start(name)};\n" for name in self._placed())
                + _indented(self._prefetch_next())
                + _indented(body)
                + "        }\n"
                + ("        free(sx_scratch);\n" if scratch else "")
                + "    }\n")

    def _prefetch_next(self) -> str:
        """Prefetch the next task's heads of the inputs read by token (the thread's next task under a static
        schedule): its rows are strided, so the hardware prefetcher does not fetch them ahead."""
        T, D = self.seq, self.head_dim
        names = [name for name in ("q", "k", "v", "do") if name in self.dtypes]
        lines = "".join(
            f"                __builtin_prefetch(a_{name} + {self._start(name, 'nb', 'nh')}"
            f" + t * {self.placements[name][3]}LL + {d});\n"
            for name in names for d in range(0, D, 16))
        return (f"        if (task + 1 < {self.tasks}LL) {{\n"
                f"            const long long nb = (task + 1) / {self.heads}LL, nh = (task + 1) % {self.heads}LL;\n"
                f"            for (long long t = 0; t < {T}LL; ++t) {{\n"
                + lines
                + "            }\n"
                "        }\n")

    # -- operands ---------------------------------------------------------------------------------------

    def _placed(self) -> list[str]:
        return [name for name in self.placements if name in self.dtypes]

    def _start(self, name: str, batch: str = "b", head: str = "h") -> str:
        """The element index where the head `head` of batch `batch` (C expressions) of `name` starts."""
        offset, batch_stride, head_stride, _ = self.placements[name]
        return f"{offset}LL + {batch} * {batch_stride}LL + {head} * {head_stride}LL"

    def _at(self, name: str, token: str, feature: str) -> str:
        """The element index of (token, feature) of this task's head of `name`."""
        return f"{name}0 + ({token}) * {self.placements[name][3]}LL + {feature}"

    def _ld(self, name: str, token: str, feature: str) -> str:
        return load(self.dtypes[name], f"a_{name}", self._at(name, token, feature))

    def _st(self, name: str, token: str, feature: str, value: str) -> str:
        return store(self.dtypes[name], f"a_{name}", self._at(name, token, feature), value)

    def _rows(self, *names: str) -> tuple[list[tuple[str, int]], str]:
        """Each head of `names` as f32 rows `<name>_rows`, row stride `<name>_ld`: f32 in place (token
        stride), other storage widened into scratch (stride D). The scratch arrays and the C."""
        T, D = self.seq, self.head_dim
        scratch, c = [], ""
        for name in names:
            if self.dtypes[name] == "f32":
                c += (f"        const float* {name}_rows = a_{name} + {name}0;\n"
                      f"        const long long {name}_ld = {self.placements[name][3]}LL;\n")
                continue
            scratch.append((f"{name}_wide", T * D))
            c += (f"        for (long long t = 0; t < {T}LL; ++t)\n"
                  f"            for (long long d = 0; d < {D}LL; ++d) {name}_wide[t * {D}LL + d] = {self._ld(name, 't', 'd')};\n"
                  f"        const float* {name}_rows = {name}_wide;\n"
                  f"        const long long {name}_ld = {D}LL;\n")
        return scratch, c

    def _columns(self, name: str, into: str) -> str:
        """This head of `name` widened to f32 and transposed: into[d * padded + t] (zero from seq on); f32 by
        8 × 8 blocks of whole vectors of tokens."""
        T, D, Tp = self.seq, self.head_dim, self.padded
        whole = T // VECTOR * VECTOR if self.dtypes[name] == "f32" else 0
        blocks = (f"        for (long long t0 = 0; t0 < {whole}LL; t0 += {VECTOR}LL)\n"
                  f"            for (long long d0 = 0; d0 < {D}LL; d0 += {VECTOR}LL)\n"
                  f"                sx_att_transpose8(a_{name} + {self._at(name, 't0', 'd0')}, {self.placements[name][3]}LL, "
                  f"{into} + d0 * {Tp}LL + t0, {Tp}LL);\n") if whole else ""
        return (f"        for (long long d = 0; d < {D}LL; ++d)\n"
                f"            for (long long t = {T}LL; t < {Tp}LL; ++t) {into}[d * {Tp}LL + t] = 0.0f;\n"
                + blocks
                + f"        for (long long t = {whole}LL; t < {T}LL; ++t)\n"
                f"            for (long long d = 0; d < {D}LL; ++d) {into}[d * {Tp}LL + t] = {self._ld(name, 't', 'd')};\n")

    def _blocks(self, block: str) -> str:
        """The loop over blocks of `QUERY_BLOCK` query rows i0 .. i0 + 7, `rows` of them in the sequence, each
        seeing the keys below `span` (the last row's keys rounded up to a vector; `keys` of them in the
        sequence), `block` the C of one. The rows past the sequence repeat its last row and are not stored."""
        T = self.seq
        last = f"i0 + {QUERY_BLOCK}LL < {T}LL ? i0 + {QUERY_BLOCK}LL : {T}LL" if self.causal else f"{T}LL"
        return (f"        for (long long i0 = 0; i0 < {T}LL; i0 += {QUERY_BLOCK}LL) {{\n"
                f"            const long long rows = sx_imin({QUERY_BLOCK}LL, {T}LL - i0);\n"
                f"            const long long span = (({last}) + {VECTOR - 1}LL) / {VECTOR}LL * {VECTOR}LL;\n"
                f"            const long long keys = sx_imin(span, {T}LL);\n"
                f"{block}"
                "        }\n")

    def _rows_of_block(self, body: str) -> str:
        """`body` for each row r of a block that is in the sequence, with `limit` the last key it sees."""
        limit = "i0 + r" if self.causal else f"{self.seq - 1}LL"
        return (f"            for (long long r = 0; r < rows; ++r) {{\n"
                f"                const long long limit = {limit};\n"
                f"{body}"
                "            }\n")

    def _store_rows(self, name: str, value: str) -> str:
        """Each row r of a block that is in the sequence stored into `name`: `value` (C of r and d) at each d."""
        return self._rows_of_block("                #pragma omp simd\n"
                                   f"                for (long long d = 0; d < {self.head_dim}LL; ++d) "
                                   f"{self._st(name, 'i0 + r', 'd', value)}\n")

    def _scores(self, rows: str, columns: str, into: str) -> str:
        """into[r][j] = <rows>[i0 + r] · <columns>[:, j] for the block's rows and keys below span."""
        D, Tp = self.head_dim, self.padded
        return (f"            sx_att_product({QUERY_BLOCK}LL, span, {D}LL, rows, {rows}_rows + i0 * {rows}_ld, {rows}_ld, 1LL, "
                f"{columns}, {Tp}LL, {into}, {Tp}LL, 0);\n")

    def _probabilities(self) -> str:
        """p[r][j] = exp(scale·q·k - lse), ds[r][j] = p (dO·V - D); zero for the keys a row does not see and
        for the rows past the sequence."""
        T, Tp = self.seq, self.padded
        return (self._scores("q", "kt", "p") + self._scores("do", "vt", "ds")
                + f"            for (long long r = 0; r < {QUERY_BLOCK}LL; ++r) {{\n"
                f"                const long long limit = r >= rows ? -1 : {'i0 + r' if self.causal else f'{T - 1}LL'};\n"
                f"                const float lse_r = limit < 0 ? 0.0f : a_lse[task * {T}LL + i0 + r];\n"
                "                const float delta_r = delta[r];\n"
                f"                float* p_r = p + r * {Tp}LL;\n"
                f"                float* ds_r = ds + r * {Tp}LL;\n"
                "                #pragma omp simd\n"
                "                for (long long j = 0; j < span; ++j) {\n"
                f"                    const float pj = j <= limit ? sx_expf(p_r[j] * {self.scale} - lse_r) : 0.0f;\n"
                "                    ds_r[j] = pj * (ds_r[j] - delta_r);\n"
                "                    p_r[j] = pj;\n"
                "                }\n"
                "            }\n")

    # -- the kernels: each (scratch arrays, C of one task) ------------------------------------------------

    def _forward(self) -> tuple[list[tuple[str, int]], str]:
        T, D, Tp = self.seq, self.head_dim, self.padded
        wide, rows = self._rows("q", "v")
        softmax = (f"                float* s_r = s + r * {Tp}LL;\n"
                   "                #pragma omp simd\n"
                   "                for (long long j = 0; j < span; ++j)\n"
                   f"                    s_r[j] = j <= limit ? s_r[j] * {self.scale} : -INFINITY;\n"
                   "                float l;\n"
                   "                const float m = sx_att_softmax_row(s_r, span, &l);\n"
                   "                sums[r] = l;\n"
                   f"                a_lse[task * {T}LL + i0 + r] = m + logf(l);\n")
        block = (self._scores("q", "kt", "s")
                 + self._rows_of_block(softmax)
                 + f"            sx_att_product({QUERY_BLOCK}LL, {D}LL, keys, rows, s, {Tp}LL, 1LL, v_rows, v_ld, acc, {D}LL, 0);\n"
                 + self._store_rows('o', f'acc[r * {D}LL + d] / sums[r]'))
        scratch = [("kt", D * Tp), ("s", QUERY_BLOCK * Tp), ("acc", QUERY_BLOCK * D), ("sums", QUERY_BLOCK), *wide]
        return scratch, self._columns("k", "kt") + rows + self._blocks(block)

    def _backward(self) -> tuple[list[tuple[str, int]], str]:
        """dQ, dK and dV of one head, block by block of query rows: the block's row sums D = dO·O, its P and
        dS = P (dO·Vᵀ - D), then dV += Pᵀ·dO and dK += dSᵀ·Q over the keys it sees (onto f32 accumulators,
        stored once the head is done) and its own rows of dQ = dS·K."""
        T, D, Tp = self.seq, self.head_dim, self.padded
        wide, rows = self._rows("q", "do", "k", "o")
        deltas = (f"            for (long long r = 0; r < {QUERY_BLOCK}LL; ++r)\n"
                  f"                delta[r] = r < rows ? sx_att_dot(do_rows + (i0 + r) * do_ld, o_rows + (i0 + r) * o_ld, "
                  f"{D}LL) : 0.0f;\n")
        block = (deltas
                 + self._probabilities()
                 + f"            sx_att_product(span, {D}LL, rows, span, p, 1LL, {Tp}LL, do_rows + i0 * do_ld, do_ld, dv_acc, {D}LL, 1);\n"
                 f"            sx_att_product(span, {D}LL, rows, span, ds, 1LL, {Tp}LL, q_rows + i0 * q_ld, q_ld, dk_acc, {D}LL, 1);\n"
                 f"            sx_att_product({QUERY_BLOCK}LL, {D}LL, keys, rows, ds, {Tp}LL, 1LL, k_rows, k_ld, acc, {D}LL, 0);\n"
                 + self._store_rows('dq', f'acc[r * {D}LL + d] * {self.scale}'))
        scratch = [("kt", D * Tp), ("vt", D * Tp), ("p", QUERY_BLOCK * Tp), ("ds", QUERY_BLOCK * Tp),
                   ("dk_acc", Tp * D), ("dv_acc", Tp * D), ("acc", QUERY_BLOCK * D), ("delta", QUERY_BLOCK), *wide]
        return (scratch,
                self._columns("k", "kt") + self._columns("v", "vt") + rows
                + f"        for (long long e = 0; e < {Tp * D}LL; ++e) {{ dk_acc[e] = 0.0f; dv_acc[e] = 0.0f; }}\n"
                + self._blocks(block)
                + f"        for (long long t = 0; t < {T}LL; ++t) {{\n"
                "            #pragma omp simd\n"
                f"            for (long long d = 0; d < {D}LL; ++d) {{\n"
                f"                {self._st('dk', 't', 'd', f'dk_acc[t * {D}LL + d] * {self.scale}')}\n"
                f"                {self._st('dv', 't', 'd', f'dv_acc[t * {D}LL + d]')}\n"
                "            }\n"
                "        }\n")


def _indented(code: str) -> str:
    """`code` (a task's C, 8 spaces deep) 4 spaces deeper: inside the parallel region."""
    return "".join(f"    {line}" if line.strip() else line for line in code.splitlines(keepends=True))


def attention_code(kernel: Operation) -> str:
    """The body of an attention kernel's C function."""
    return AttentionKernel(kernel).code()
