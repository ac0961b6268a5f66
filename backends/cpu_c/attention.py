"""C for the `attention` kernels: causal or full `softmax(scale·Q·Kᵀ)·V` and its backward, one head a task.

The kernels `match-patterns` makes of an attention region (`passes/patterns/attention.py`; the contract is
`backends/cuda/render/attention.py`'s): the forward writes O and the log-sum-exp of each query row's scores
(`lse`, f32 [batch, heads, seq]); the backward is three steps, as on the GPU — `delta` (D = rowsum(dO·O)),
`dkdv` and `dq` — each recomputing the probabilities P = exp(scale·q·k − lse) from Q and K, so nothing of
size seq × seq is kept between steps. Every operand is read or written where its `placements` entry says
([offset, batch stride, head stride, token stride] in elements of the buffer it is bound to; the head-dim
stride is 1): Q, K and V are three column ranges of one packed projection, O and the gradients merged
heads (or contiguous heads where the graph does not merge them).

On a CPU one (batch, head) is one iteration of an OpenMP loop (static schedule), FlashAttention-2's
structure without its tiles in shared memory: the head's Q, K, V and dO are widened to f32 once (K and V
also transposed, [head_dim][seq], zero-padded to a multiple of 8 keys), then blocks of `QUERY_BLOCK` query
rows go through microkernels whose sums stay in vector registers (`ATTENTION_PRELUDE`): the scores
Q·Kᵀ and dP = dO·Vᵀ of a block (keys in vectors), its probabilities from the running maximum and sum (the
forward) or the saved log-sum-exp (the backward), then P·V, dS·K, or dV += Pᵀ·dO and dK += dSᵀ·Q. A block
reads the keys up to its last row's (rounded up to a vector) and masks the rest, so causal attention
skips the key blocks above the diagonal. Every sum runs in an order set by the sizes alone (over the head
dimension, keys or query blocks in ascending order; a block's rows in a fixed pairwise tree) within one
task, so the results do not depend on the thread count; all math is f32 and each output is rounded once
when stored.
"""

from __future__ import annotations

from ...dialects.core import Operation
from .kernels import STORAGE, UnsupportedKernel, float_literal, load, parallel_for, store

#: Query rows handled together: the microkernels keep one vector of each row's sums in a register (8 of the
#: 16 AVX2 registers). The same as `VECTOR`, so the zero padding of a head to a vector covers the last block.
QUERY_BLOCK = 8
#: f32 lanes of the microkernels' vectors (an AVX2 register; GCC's and Clang's vector extensions lower
#: them to whatever the host has). Head dimensions are multiples of it (the attention targets take those).
VECTOR = 8

def _unrolled(template: str, rows: range = range(QUERY_BLOCK)) -> str:
    """`template` once per row r of a block (`{r}`), for the microkernels: their sums stay in registers."""
    return "".join(template.format(r=r) for r in rows)


def _tree(name: str) -> str:
    """name0 = the sum of name0 .. name7 in a fixed pairwise tree."""
    lines, width = [], QUERY_BLOCK // 2
    while width:
        lines += [f"            {name}{r} += {name}{r + width};\n" for r in range(width)]
        width //= 2
    return "".join(lines)


#: The microkernels of every attention kernel, at the start of each unit of kernels (`render.py`), over a
#: block of `QUERY_BLOCK` query rows (its sums in as many vector registers): `sx_att_dots`, out[r][j] =
#: a[r]·bt[:, j] for j < span (a multiple of VECTOR; `bt` a head transposed, row length `ldb`, and `out`
#: the same); `sx_att_weighted`, out[r][:] = Σ_j w[r][j] x[j][:] over j < span, in order;
#: `sx_att_accumulate`, acc[j][:] += the rows' w[r][j] x[r][:] summed in a fixed pairwise tree;
#: `sx_att_softmax_row`. Scalar-times-vector products, unfused (`-ffp-contract=off`), as the kernels'
#: other math.
ATTENTION_PRELUDE = (r"""
typedef float sx_v8 __attribute__((vector_size(32), aligned(4), __may_alias__));
static inline __attribute__((always_inline)) void sx_att_dots(long long D, const float* a, const float* bt, long long ldb,
                                                             long long span, float* out) {
    for (long long j = 0; j < span; j += 8) {
""" + _unrolled("        sx_v8 acc{r} = {{0}};\n") + r"""        for (long long d = 0; d < D; ++d) {
            const sx_v8 b = *(const sx_v8*)(bt + d * ldb + j);
""" + _unrolled("            acc{r} += a[{r} * D + d] * b;\n") + r"""        }
""" + _unrolled("        *(sx_v8*)(out + {r} * ldb + j) = acc{r};\n") + r"""    }
}
static inline __attribute__((always_inline)) void sx_att_weighted(long long span, const float* w, long long ldw,
                                                                 const float* x, long long D, float* out) {
    for (long long d = 0; d < D; d += 8) {
""" + _unrolled("        sx_v8 acc{r} = {{0}};\n") + r"""        for (long long j = 0; j < span; ++j) {
            const sx_v8 v = *(const sx_v8*)(x + j * D + d);
""" + _unrolled("            acc{r} += w[{r} * ldw + j] * v;\n") + r"""        }
""" + _unrolled("        *(sx_v8*)(out + {r} * D + d) = acc{r};\n") + r"""    }
}
static inline __attribute__((always_inline)) void sx_att_accumulate(long long span, const float* w, long long ldw,
                                                                   const float* x, long long D, float* acc) {
    for (long long j = 0; j < span; ++j) {
        for (long long d = 0; d < D; d += 8) {
""" + _unrolled("            sx_v8 t{r} = w[{r} * ldw + j] * *(const sx_v8*)(x + {r} * D + d);\n") + _tree("t") + r"""            *(sx_v8*)(acc + j * D + d) += t0;
        }
    }
}
/* A score row's maximum m (NaN-propagating, as sx_fmax) and the sum of exp(x - m), each over 8 lanes of
   vectors combined in a fixed tree; x[j] becomes exp(x[j] - m). */
typedef int sx_i8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) float sx_att_softmax_row(float* x, long long span, float* sum) {
    sx_v8 top = (sx_v8){0} - INFINITY, total = {0};
    for (long long j = 0; j < span; j += 8) {
        const sx_v8 v = *(const sx_v8*)(x + j);
        const sx_i8 larger = (v > top) | (v != v);
        top = (sx_v8)(((sx_i8)v & larger) | ((sx_i8)top & ~larger));
    }
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = top[l];
    for (int width = 4; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] = sx_fmax(lanes[l], lanes[l + width]);
    const float m = lanes[0];
    for (long long j = 0; j < span; j += 8) {
        sx_v8 e;
        for (int l = 0; l < 8; ++l) e[l] = sx_expf(x[j + l] - m);
        *(sx_v8*)(x + j) = e;
        total += e;
    }
    for (int l = 0; l < 8; ++l) lanes[l] = total[l];
    for (int width = 4; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    *sum = lanes[0];
    return m;
}
""")


class AttentionKernel:
    """The body of one attention kernel's C function (a forward, or one step of the backward)."""

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
        self.step = int(attrs.get("step", 0))
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
        if self.direction == "forward":
            body = self._forward()
        else:
            body = (self._delta, self._dkdv, self._dq)[self.step]()
        T, D = self.seq, self.head_dim
        work = self.tasks * T * T * D
        return (self.head
                + f"    {parallel_for(self.tasks, work)}\n"
                + f"    for (long long task = 0; task < {self.tasks}LL; ++task) {{\n"
                + f"        const long long b = task / {self.heads}LL, h = task % {self.heads}LL;\n"
                + "".join(f"        const long long {name}0 = {self._start(name)};\n" for name in self._placed())
                + body
                + "    }\n")

    # -- operands ---------------------------------------------------------------------------------------

    def _placed(self) -> list[str]:
        return [name for name in self.placements if name in self.dtypes]

    def _start(self, name: str) -> str:
        offset, batch, head, _ = self.placements[name]
        return f"{offset}LL + b * {batch}LL + h * {head}LL"

    def _at(self, name: str, token: str, feature: str) -> str:
        """The element index of (token, feature) of this task's head of `name`."""
        return f"{name}0 + ({token}) * {self.placements[name][3]}LL + {feature}"

    def _ld(self, name: str, token: str, feature: str) -> str:
        return load(self.dtypes[name], f"a_{name}", self._at(name, token, feature))

    def _st(self, name: str, token: str, feature: str, value: str) -> str:
        return store(self.dtypes[name], f"a_{name}", self._at(name, token, feature), value)

    def _scratch(self, *arrays: tuple[str, int]) -> str:
        return "".join(f"        float* {name} = (float*)malloc({count}LL * sizeof(float));\n" for name, count in arrays)

    @staticmethod
    def _free(*names: str) -> str:
        return "".join(f"        free({name});\n" for name in names)

    def _rows(self, name: str, into: str) -> str:
        """This head of `name` widened to f32 rows: into[t * D + d] (rows from seq to `padded` zero)."""
        T, D = self.seq, self.head_dim
        return (f"        for (long long t = 0; t < {T}LL; ++t)\n"
                f"            for (long long d = 0; d < {D}LL; ++d) {into}[t * {D}LL + d] = {self._ld(name, 't', 'd')};\n"
                f"        for (long long e = {T * D}LL; e < {self.padded * D}LL; ++e) {into}[e] = 0.0f;\n")

    def _columns(self, name: str, into: str) -> str:
        """This head of `name` widened to f32 and transposed: into[d * padded + t] (zero from seq on)."""
        T, D, Tp = self.seq, self.head_dim, self.padded
        return (f"        for (long long d = 0; d < {D}LL; ++d)\n"
                f"            for (long long t = {T}LL; t < {Tp}LL; ++t) {into}[d * {Tp}LL + t] = 0.0f;\n"
                f"        for (long long t = 0; t < {T}LL; ++t)\n"
                f"            for (long long d = 0; d < {D}LL; ++d) {into}[d * {Tp}LL + t] = {self._ld(name, 't', 'd')};\n")

    def _blocks(self, block: str) -> str:
        """The loop over blocks of `QUERY_BLOCK` query rows i0 .. i0 + 7, each seeing the keys below `span`
        (the last row's keys rounded up to a vector), `block` the C of one. The rows past the sequence read
        the zero padding of the widened heads and are not stored."""
        T = self.seq
        keys = f"i0 + {QUERY_BLOCK}LL < {T}LL ? i0 + {QUERY_BLOCK}LL : {T}LL" if self.causal else f"{T}LL"
        return (f"        for (long long i0 = 0; i0 < {T}LL; i0 += {QUERY_BLOCK}LL) {{\n"
                f"            const long long span = (({keys}) + {VECTOR - 1}LL) / {VECTOR}LL * {VECTOR}LL;\n"
                f"{block}"
                "        }\n")

    def _rows_of_block(self, body: str) -> str:
        """`body` for each row r of a block that is in the sequence, with `limit` the last key it sees."""
        limit = "i0 + r" if self.causal else f"{self.seq - 1}LL"
        return (f"            for (long long r = 0; r < {QUERY_BLOCK}LL && i0 + r < {self.seq}LL; ++r) {{\n"
                f"                const long long limit = {limit};\n"
                f"{body}"
                "            }\n")

    def _probabilities(self) -> str:
        """p[r][j] = exp(scale·q·k - lse) from the scores in p, ds[r][j] = p (dO·V - D) from dP in ds; zero
        for the keys a row does not see and for the rows past the sequence."""
        T, D, Tp = self.seq, self.head_dim, self.padded
        return (f"            sx_att_dots({D}LL, qs + i0 * {D}LL, kt, {Tp}LL, span, p);\n"
                f"            sx_att_dots({D}LL, dos + i0 * {D}LL, vt, {Tp}LL, span, ds);\n"
                f"            for (long long r = 0; r < {QUERY_BLOCK}LL; ++r) {{\n"
                f"                const long long limit = i0 + r >= {T}LL ? -1 : {'i0 + r' if self.causal else f'{T - 1}LL'};\n"
                f"                const float lse_r = limit < 0 ? 0.0f : a_lse[task * {T}LL + i0 + r];\n"
                f"                const float delta_r = limit < 0 ? 0.0f : a_delta[task * {T}LL + i0 + r];\n"
                f"                float* p_r = p + r * {Tp}LL;\n"
                f"                float* ds_r = ds + r * {Tp}LL;\n"
                "                #pragma omp simd\n"
                "                for (long long j = 0; j < span; ++j) {\n"
                f"                    const float pj = j <= limit ? sx_expf(p_r[j] * {self.scale} - lse_r) : 0.0f;\n"
                "                    ds_r[j] = pj * (ds_r[j] - delta_r);\n"
                "                    p_r[j] = pj;\n"
                "                }\n"
                "            }\n")

    # -- the kernels ----------------------------------------------------------------------------------------

    def _forward(self) -> str:
        T, D, Tp = self.seq, self.head_dim, self.padded
        softmax = (f"                float* s_r = s + r * {Tp}LL;\n"
                   "                #pragma omp simd\n"
                   "                for (long long j = 0; j < span; ++j)\n"
                   f"                    s_r[j] = j <= limit ? s_r[j] * {self.scale} : -INFINITY;\n"
                   "                float l;\n"
                   "                const float m = sx_att_softmax_row(s_r, span, &l);\n"
                   "                sums[r] = l;\n"
                   f"                a_lse[task * {T}LL + i0 + r] = m + logf(l);\n")
        store = (f"                for (long long d = 0; d < {D}LL; ++d) "
                 f"{self._st('o', 'i0 + r', 'd', f'acc[r * {D}LL + d] / sums[r]')}\n")
        block = (f"            sx_att_dots({D}LL, qs + i0 * {D}LL, kt, {Tp}LL, span, s);\n"
                 + self._rows_of_block(softmax)
                 + f"            sx_att_weighted(span, s, {Tp}LL, vs, {D}LL, acc);\n"
                 + self._rows_of_block(store))
        return (self._scratch(("kt", D * Tp), ("vs", Tp * D), ("qs", Tp * D), ("s", QUERY_BLOCK * Tp),
                              ("acc", QUERY_BLOCK * D), ("sums", QUERY_BLOCK))
                + f"        for (long long e = 0; e < {QUERY_BLOCK * Tp}LL; ++e) s[e] = 0.0f;\n"
                + self._columns("k", "kt") + self._rows("v", "vs") + self._rows("q", "qs")
                + self._blocks(block)
                + self._free("kt", "vs", "qs", "s", "acc", "sums"))

    def _delta(self) -> str:
        T, D = self.seq, self.head_dim
        return (f"        for (long long i = 0; i < {T}LL; ++i) {{\n"
                "            float sum = 0.0f;\n"
                f"            for (long long d = 0; d < {D}LL; ++d) sum += {self._ld('do', 'i', 'd')} * {self._ld('o', 'i', 'd')};\n"
                f"            a_delta[task * {T}LL + i] = sum;\n"
                "        }\n")

    def _backward_scratch(self, *more: tuple[str, int]) -> str:
        D, Tp = self.head_dim, self.padded
        return (self._scratch(("kt", D * Tp), ("vt", D * Tp), ("qs", Tp * D), ("dos", Tp * D),
                              ("p", QUERY_BLOCK * Tp), ("ds", QUERY_BLOCK * Tp), *more)
                + self._columns("k", "kt") + self._columns("v", "vt") + self._rows("q", "qs") + self._rows("do", "dos"))

    def _dkdv(self) -> str:
        T, D, Tp = self.seq, self.head_dim, self.padded
        block = (self._probabilities()
                 + f"            sx_att_accumulate(span, p, {Tp}LL, dos + i0 * {D}LL, {D}LL, dv_acc);\n"
                 f"            sx_att_accumulate(span, ds, {Tp}LL, qs + i0 * {D}LL, {D}LL, dk_acc);\n")
        return (self._backward_scratch(("dk_acc", Tp * D), ("dv_acc", Tp * D))
                + f"        for (long long e = 0; e < {Tp * D}LL; ++e) {{ dk_acc[e] = 0.0f; dv_acc[e] = 0.0f; }}\n"
                + self._blocks(block)
                + f"        for (long long t = 0; t < {T}LL; ++t)\n"
                f"            for (long long d = 0; d < {D}LL; ++d) {{\n"
                f"                {self._st('dk', 't', 'd', f'dk_acc[t * {D}LL + d] * {self.scale}')}\n"
                f"                {self._st('dv', 't', 'd', f'dv_acc[t * {D}LL + d]')}\n"
                "            }\n"
                + self._free("kt", "vt", "qs", "dos", "p", "ds", "dk_acc", "dv_acc"))

    def _dq(self) -> str:
        D, Tp = self.head_dim, self.padded
        store = (f"                for (long long d = 0; d < {D}LL; ++d) "
                 f"{self._st('dq', 'i0 + r', 'd', f'acc[r * {D}LL + d] * {self.scale}')}\n")
        block = (self._probabilities()
                 + f"            sx_att_weighted(span, ds, {Tp}LL, ks, {D}LL, acc);\n"
                 + self._rows_of_block(store))
        return (self._backward_scratch(("ks", Tp * D), ("acc", QUERY_BLOCK * D))
                + self._rows("k", "ks")
                + self._blocks(block)
                + self._free("kt", "vt", "qs", "dos", "p", "ds", "ks", "acc"))


def attention_code(kernel: Operation) -> str:
    """The body of an attention kernel's C function."""
    return AttentionKernel(kernel).code()
