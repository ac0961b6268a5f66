// sexpgpu kernel prelude: what every generated CUDA translation unit starts with.
//
// The same text compiles with NVRTC for a GPU and with the host C++ compiler for
// cuda-sim (-DSEXPGPU_SIM -include cuda_sim.h). Storage is f32 or bf16; every
// value is loaded into f32, computed in f32 and rounded once when stored.
// Reductions are deterministic: each thread adds its elements in a fixed order,
// warps combine by a butterfly of shuffles (every lane ends with the same bits),
// and blocks combine warp results in warp order.

#ifndef SEXPGPU_SIM
#include <cuda_bf16.h>
#endif

// NVRTC has no <math.h>: INFINITY, NAN and FLT_MAX are not defined there.
#define SX_INF __int_as_float(0x7f800000)
#define SX_NAN __int_as_float(0x7fffffff)
#define SX_FLT_MAX 3.40282347e+38f
#define SX_WARP 32
#define SX_FULL_MASK 0xffffffffu
#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// ---- element conversion: storage type <-> f32 ---------------------------------------------

__device__ __forceinline__ float sx_float(float v) { return v; }
__device__ __forceinline__ float sx_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T sx_round(float v);
template <> __device__ __forceinline__ float sx_round<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 sx_round<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <class T> __device__ __forceinline__ float sx_ld(const T* p) { return sx_float(*p); }
template <class T> __device__ __forceinline__ void sx_st(T* p, float v) { *p = sx_round<T>(v); }

// ---- packed loads and stores: N consecutive elements in accesses of up to 16 bytes ---------
// (x128 when N * sizeof(T) >= 16). The address must be aligned to min(N * sizeof(T), 16): rows
// whose length is a multiple of N, in buffers aligned to 16 bytes (cudaMalloc and the arena give
// 256). f32 partial sums kept beside bf16 rows of 8 take two 16-byte accesses.

template <int BYTES> struct sx_raw;
template <> struct sx_raw<2> { typedef unsigned short type; };
template <> struct sx_raw<4> { typedef unsigned int type; };
template <> struct sx_raw<8> { typedef uint2 type; };
template <> struct sx_raw<16> { typedef uint4 type; };

template <int N, class T> struct sx_access {
    static constexpr int elements = N * sizeof(T) > 16 ? 16 / sizeof(T) : N;
    typedef typename sx_raw<elements * sizeof(T)>::type raw;
};

template <int N, class T> __device__ __forceinline__ void sx_ld_vec(float (&out)[N], const T* p) {
    typedef sx_access<N, T> access;
#pragma unroll
    for (int c = 0; c < N; c += access::elements) {
        const typename access::raw bits = *reinterpret_cast<const typename access::raw*>(p + c);
        const T* elements = reinterpret_cast<const T*>(&bits);
#pragma unroll
        for (int k = 0; k < access::elements; ++k) out[c + k] = sx_float(elements[k]);
    }
}

template <int N, class T> __device__ __forceinline__ void sx_st_vec(T* p, const float (&v)[N]) {
    typedef sx_access<N, T> access;
#pragma unroll
    for (int c = 0; c < N; c += access::elements) {
        typename access::raw bits;
        T* elements = reinterpret_cast<T*>(&bits);
#pragma unroll
        for (int k = 0; k < access::elements; ++k) elements[k] = sx_round<T>(v[c + k]);
        *reinterpret_cast<typename access::raw*>(p + c) = bits;
    }
}

// ---- warp reductions (all 32 lanes take part; each ends with the same value) ---------------

__device__ __forceinline__ float sx_warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(SX_FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float sx_warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(SX_FULL_MASK, v, offset));
    return v;
}

// ---- softmax statistics: a running maximum m and sum s of exp(v - m) -----------------------
// A side that has seen only -inf (or nothing) has m = -inf and s = 0 and adds nothing; its
// exp(m - max) would be exp(-inf + inf) = NaN. A NaN element makes s NaN, as it should.

__device__ __forceinline__ void sx_softmax_add(float& m, float& s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else if (v != -SX_INF) {
        s += expf(v - m);
    }
}

__device__ __forceinline__ float sx_softmax_scaled(float m, float s, float to) {
    return m == -SX_INF ? 0.0f : s * expf(m - to);
}

__device__ __forceinline__ void sx_warp_softmax(float& m, float& s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(SX_FULL_MASK, m, offset);
        const float s2 = __shfl_xor_sync(SX_FULL_MASK, s, offset);
        const float top = fmaxf(m, m2);
        s = sx_softmax_scaled(m, s, top) + sx_softmax_scaled(m2, s2, top);
        m = top;
    }
}

// ---- block reductions: blockDim.x a multiple of 32; every thread of the block calls them ---
// The trailing barrier lets the next reduction reuse the partials at once.

__device__ __forceinline__ float sx_block_sum(float v) {
    __shared__ float partials[32];
    const int lane = threadIdx.x % SX_WARP, warp = threadIdx.x / SX_WARP, warps = blockDim.x / SX_WARP;
    v = sx_warp_sum(v);
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    v = sx_warp_sum(lane < warps ? partials[lane] : 0.0f);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float sx_block_max(float v) {
    __shared__ float partials[32];
    const int lane = threadIdx.x % SX_WARP, warp = threadIdx.x / SX_WARP, warps = blockDim.x / SX_WARP;
    v = sx_warp_max(v);
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    v = sx_warp_max(lane < warps ? partials[lane] : -SX_INF);
    __syncthreads();
    return v;
}

__device__ __forceinline__ void sx_block_softmax(float& m, float& s) {
    const float top = sx_block_max(m);
    s = sx_block_sum(sx_softmax_scaled(m, s, top));
    m = top;
}

// ---- raw moves: N elements of any type, bits unchanged ------------------------------------

template <int N, class T> __device__ __forceinline__ void sx_st_same(T* p, T v) {
    typedef typename sx_raw<N * sizeof(T)>::type raw;
    raw bits;
    T* elements = reinterpret_cast<T*>(&bits);
#pragma unroll
    for (int k = 0; k < N; ++k) elements[k] = v;
    *reinterpret_cast<raw*>(p) = bits;
}

template <int N, class T> __device__ __forceinline__ void sx_move(T* to, const T* from) {
    typedef typename sx_raw<N * sizeof(T)>::type raw;
    *reinterpret_cast<raw*>(to) = *reinterpret_cast<const raw*>(from);
}
