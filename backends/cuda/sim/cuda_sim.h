// cuda_sim.h: the CUDA emulation header of sexpgpu's simulated device, cuda-sim.
//
// The same CUDA translation unit that NVRTC compiles for a GPU compiles with
// the host C++ compiler when this header is force-included:
//
//     g++ -std=c++17 -O2 -fPIC -shared -DSEXPGPU_SIM -include cuda_sim.h -x c++ src.cu
//
// (sexpgpu.backends.cuda.sim adds the flags it needs and an export section
// after the source; docs/cuda.md, section cuda-sim, says how it all works.)
//
// Execution model: blocks run one at a time on the calling OS thread; every
// thread of a block is a fiber with its own stack, switched by hand-written
// assembly at each synchronisation point (__syncthreads, __syncwarp, the warp
// shuffles and votes, thread exit). Shared memory is thread_local storage:
// all fibers of a block run on one OS thread, so a thread_local IS
// block-shared, and `extern thread_local` makes `extern __shared__` legal C++.
#ifndef SEXPGPU_CUDA_SIM_H
#define SEXPGPU_CUDA_SIM_H

#if !defined(__linux__) || !(defined(__x86_64__) || defined(__aarch64__))
#error "cuda-sim runs on Linux on x86-64 or aarch64 only (its fibers switch with hand-written assembly)"
#endif

#ifndef SEXPGPU_SIM
#define SEXPGPU_SIM 1
#endif

#include <assert.h>
#include <float.h>
#include <limits.h>
#include <link.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <limits>
#include <type_traits>
#include <utility>

// The runtime's state must stay private to each kernel module: hidden symbols
// are never merged across modules (default-visibility inline variables would
// be, as STB_GNU_UNIQUE).
#pragma GCC visibility push(hidden)

// ---------------------------------------------------------------------------
// Qualifiers and attributes
// ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __shared__ thread_local

// ---------------------------------------------------------------------------
// Vector types (CUDA's alignment: 2 and 4 components aligned to their size,
// capped at 16 bytes; 3 components aligned to one component)
// ---------------------------------------------------------------------------
#define SEXPGPU_SIM_VECTOR_TYPES(T, name)                                                      \
    struct name##1 { T x; };                                                                   \
    struct __attribute__((aligned(2 * sizeof(T)))) name##2 { T x, y; };                        \
    struct name##3 { T x, y, z; };                                                             \
    struct __attribute__((aligned(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16))) name##4 { T x, y, z, w; }; \
    inline name##1 make_##name##1(T x) { return name##1{x}; }                                  \
    inline name##2 make_##name##2(T x, T y) { return name##2{x, y}; }                          \
    inline name##3 make_##name##3(T x, T y, T z) { return name##3{x, y, z}; }                  \
    inline name##4 make_##name##4(T x, T y, T z, T w) { return name##4{x, y, z, w}; }

SEXPGPU_SIM_VECTOR_TYPES(signed char, char)
SEXPGPU_SIM_VECTOR_TYPES(unsigned char, uchar)
SEXPGPU_SIM_VECTOR_TYPES(short, short)
SEXPGPU_SIM_VECTOR_TYPES(unsigned short, ushort)
SEXPGPU_SIM_VECTOR_TYPES(int, int)
SEXPGPU_SIM_VECTOR_TYPES(unsigned int, uint)
SEXPGPU_SIM_VECTOR_TYPES(long, long)
SEXPGPU_SIM_VECTOR_TYPES(unsigned long, ulong)
SEXPGPU_SIM_VECTOR_TYPES(long long, longlong)
SEXPGPU_SIM_VECTOR_TYPES(unsigned long long, ulonglong)
SEXPGPU_SIM_VECTOR_TYPES(float, float)
SEXPGPU_SIM_VECTOR_TYPES(double, double)
#undef SEXPGPU_SIM_VECTOR_TYPES

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

constexpr int warpSize = 32;

// ---------------------------------------------------------------------------
// bfloat16, converting bit for bit as CUDA does: cuda_bf16.hpp's host path and
// the device's cvt.rn.bf16.f32 round to nearest even and turn every NaN into
// the canonical 0x7fff.
// ---------------------------------------------------------------------------
struct __nv_bfloat16_raw { unsigned short x; };
struct __nv_bfloat162_raw { unsigned short x, y; };

namespace sexpgpu_sim {
inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// cuda_bf16.hpp's __internal_float2bfloat16: truncated bits, remainder, NaN canonicalised.
inline unsigned short bf16_truncate(float f, uint32_t& sign, uint32_t& remainder) {
    uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) { sign = 0; remainder = 0; return 0x7fff; }
    sign = x >> 31;
    remainder = x << 16;
    return static_cast<unsigned short>(x >> 16);
}
inline unsigned short bf16_rn(float f) {
    uint32_t sign, rem;
    unsigned short r = bf16_truncate(f, sign, rem);
    if (rem > 0x80000000u || (rem == 0x80000000u && (r & 1u))) ++r;
    return r;
}
inline unsigned short bf16_rz(float f) { uint32_t s, rem; return bf16_truncate(f, s, rem); }
inline unsigned short bf16_rd(float f) {
    uint32_t sign, rem;
    unsigned short r = bf16_truncate(f, sign, rem);
    return (rem != 0 && sign != 0) ? static_cast<unsigned short>(r + 1) : r;
}
inline unsigned short bf16_ru(float f) {
    uint32_t sign, rem;
    unsigned short r = bf16_truncate(f, sign, rem);
    return (rem != 0 && sign == 0) ? static_cast<unsigned short>(r + 1) : r;
}
// cuda_bf16.hpp's __double2bfloat16: round to odd into f32, then to nearest even.
inline unsigned short bf16_from_double(double x) {
    float f = static_cast<float>(x);
    double d = static_cast<double>(f);
    uint32_t u = float_bits(f);
    bool not_nan = (u << 1) <= 0xFF000000u;
    if (x > 0.0 && d > x) --u;
    if (x < 0.0 && d < x) --u;
    if (d != x && not_nan) u |= 1u;
    return bf16_rn(bits_float(u));
}
inline float bf16_to_float(unsigned short h) { return bits_float(static_cast<uint32_t>(h) << 16); }
}  // namespace sexpgpu_sim

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(sexpgpu_sim::bf16_rn(f)) {}
    __nv_bfloat16(double d) : __x(sexpgpu_sim::bf16_from_double(d)) {}
    template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
    __nv_bfloat16(I i) : __x(sexpgpu_sim::bf16_from_double(static_cast<double>(i))) {}
    __nv_bfloat16& operator=(float f) { __x = sexpgpu_sim::bf16_rn(f); return *this; }
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) { __x = r.x; return *this; }
    operator float() const { return sexpgpu_sim::bf16_to_float(__x); }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 sexpgpu_sim_bf16_bits(unsigned short bits) { return __nv_bfloat16_raw{bits}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_rn(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_rn(f)); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_rz(f)); }
inline __nv_bfloat16 __float2bfloat16_rd(float f) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_rd(f)); }
inline __nv_bfloat16 __float2bfloat16_ru(float f) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_ru(f)); }
inline __nv_bfloat16 __double2bfloat16(double d) { return sexpgpu_sim_bf16_bits(sexpgpu_sim::bf16_from_double(d)); }
inline float __bfloat162float(__nv_bfloat16 h) { return sexpgpu_sim::bf16_to_float(h.__x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return sexpgpu_sim_bf16_bits(u); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b)); }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2(__bfloat162float(v.x), __bfloat162float(v.y)); }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }

// bf16 arithmetic: one f32 operation rounded once to bf16 is the correctly
// rounded bf16 result (f32 has more than 2*8+2 significand bits), which is
// what the device's bf16 instructions give.
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(float(a) + float(b)); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(float(a) - float(b)); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(float(a) * float(b)); }
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(float(a) / float(b)); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) { return __float2bfloat16_rn(fmaf(float(a), float(b), float(c))); }
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return sexpgpu_sim_bf16_bits(a.__x ^ 0x8000u); }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return sexpgpu_sim_bf16_bits(a.__x & 0x7fffu); }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fmaxf(float(a), float(b))); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fminf(float(a), float(b))); }
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hsub(a.x, b.x), __hsub(a.y, b.y)); }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) { return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hdiv(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __hneg(a); }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hadd(a, b); }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hsub(a, b); }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hmul(a, b); }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hdiv(a, b); }
inline bool operator==(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) == float(b); }
inline bool operator!=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) != float(b); }
inline bool operator<(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) < float(b); }
inline bool operator>(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) > float(b); }
inline bool operator<=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) <= float(b); }
inline bool operator>=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) >= float(b); }

// ---------------------------------------------------------------------------
// Math. <math.h> gives the float functions and C++ overloads (sqrt(float),
// isnan, ...) in the global namespace; the device's fast intrinsics are the
// precise host functions here (docs/cuda.md: what cuda-sim cannot catch).
// ---------------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
inline float fdividef(float a, float b) { return a / b; }

inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }

namespace sexpgpu_sim {
// The device's float-to-integer conversions saturate and send NaN to 0.
template <class I>
inline I saturate_to(double v) {
    if (v != v) return 0;
    if (v <= static_cast<double>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (v >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return static_cast<I>(v);
}
}  // namespace sexpgpu_sim
inline int __float2int_rn(float x) { return sexpgpu_sim::saturate_to<int>(nearbyint(x)); }
inline int __float2int_rz(float x) { return sexpgpu_sim::saturate_to<int>(trunc(x)); }
inline int __float2int_rd(float x) { return sexpgpu_sim::saturate_to<int>(floor(x)); }
inline int __float2int_ru(float x) { return sexpgpu_sim::saturate_to<int>(ceil(x)); }
inline unsigned int __float2uint_rn(float x) { return sexpgpu_sim::saturate_to<unsigned int>(nearbyint(x)); }
inline unsigned int __float2uint_rz(float x) { return sexpgpu_sim::saturate_to<unsigned int>(trunc(x)); }
inline float __int2float_rn(int i) { return static_cast<float>(i); }
inline float __uint2float_rn(unsigned int i) { return static_cast<float>(i); }

// CUDA's min and max: any two arithmetic types, with the usual promotions;
// on floating point they are fminf/fmaxf (a NaN operand gives the other one).
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline auto min(A a, B b) -> decltype(a + b) {
    using C = decltype(a + b);
    if constexpr (std::is_floating_point<C>::value) return fmin(static_cast<C>(a), static_cast<C>(b));
    else return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline auto max(A a, B b) -> decltype(a + b) {
    using C = decltype(a + b);
    if constexpr (std::is_floating_point<C>::value) return fmax(static_cast<C>(a), static_cast<C>(b));
    else return static_cast<C>(a) > static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32); }

// Cache-hinted loads and stores are plain accesses.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// Fences order nothing on one OS thread; they stay compiler barriers.
inline void __threadfence() { __asm__ __volatile__("" ::: "memory"); }
inline void __threadfence_block() { __asm__ __volatile__("" ::: "memory"); }
inline void __threadfence_system() { __asm__ __volatile__("" ::: "memory"); }
inline void __nanosleep(unsigned int) {}
inline long long clock64() { static long long ticks = 0; return ++ticks; }

// ---------------------------------------------------------------------------
// Atomics: fibers are never preempted, so a read-modify-write is atomic.
// ---------------------------------------------------------------------------
namespace sexpgpu_sim {
template <class T, class F>
inline T atomic_update(T* address, F update) { T old = *address; *address = update(old); return old; }
}  // namespace sexpgpu_sim
#define SEXPGPU_SIM_ATOMIC(name, T, expr) \
    inline T name(T* address, T val) { return sexpgpu_sim::atomic_update(address, [val](T old) -> T { (void)old; return expr; }); }
SEXPGPU_SIM_ATOMIC(atomicAdd, int, static_cast<int>(static_cast<unsigned int>(old) + static_cast<unsigned int>(val)))
SEXPGPU_SIM_ATOMIC(atomicAdd, unsigned int, old + val)
SEXPGPU_SIM_ATOMIC(atomicAdd, unsigned long long, old + val)
SEXPGPU_SIM_ATOMIC(atomicAdd, float, old + val)
SEXPGPU_SIM_ATOMIC(atomicAdd, double, old + val)
SEXPGPU_SIM_ATOMIC(atomicAdd, __nv_bfloat16, __hadd(old, val))
SEXPGPU_SIM_ATOMIC(atomicAdd, __nv_bfloat162, __hadd2(old, val))
SEXPGPU_SIM_ATOMIC(atomicSub, int, static_cast<int>(static_cast<unsigned int>(old) - static_cast<unsigned int>(val)))
SEXPGPU_SIM_ATOMIC(atomicSub, unsigned int, old - val)
SEXPGPU_SIM_ATOMIC(atomicExch, int, val)
SEXPGPU_SIM_ATOMIC(atomicExch, unsigned int, val)
SEXPGPU_SIM_ATOMIC(atomicExch, unsigned long long, val)
SEXPGPU_SIM_ATOMIC(atomicExch, float, val)
SEXPGPU_SIM_ATOMIC(atomicMax, int, old > val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMax, long long, old > val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMin, int, old < val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMin, long long, old < val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
SEXPGPU_SIM_ATOMIC(atomicAnd, int, old & val)
SEXPGPU_SIM_ATOMIC(atomicAnd, unsigned int, old & val)
SEXPGPU_SIM_ATOMIC(atomicAnd, unsigned long long, old & val)
SEXPGPU_SIM_ATOMIC(atomicOr, int, old | val)
SEXPGPU_SIM_ATOMIC(atomicOr, unsigned int, old | val)
SEXPGPU_SIM_ATOMIC(atomicOr, unsigned long long, old | val)
SEXPGPU_SIM_ATOMIC(atomicXor, int, old ^ val)
SEXPGPU_SIM_ATOMIC(atomicXor, unsigned int, old ^ val)
SEXPGPU_SIM_ATOMIC(atomicXor, unsigned long long, old ^ val)
SEXPGPU_SIM_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
SEXPGPU_SIM_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef SEXPGPU_SIM_ATOMIC
#define SEXPGPU_SIM_ATOMIC_CAS(T)                                                   \
    inline T atomicCAS(T* address, T compare, T val) {                              \
        return sexpgpu_sim::atomic_update(address, [=](T old) -> T { return old == compare ? val : old; }); \
    }
SEXPGPU_SIM_ATOMIC_CAS(int)
SEXPGPU_SIM_ATOMIC_CAS(unsigned int)
SEXPGPU_SIM_ATOMIC_CAS(unsigned long long)
SEXPGPU_SIM_ATOMIC_CAS(unsigned short)
#undef SEXPGPU_SIM_ATOMIC_CAS

// ---------------------------------------------------------------------------
// The runtime: fibers, the block scheduler, barriers and the warp exchange.
// ---------------------------------------------------------------------------
extern "C" {
// Saves the callee-saved registers and the floating-point control words on
// the current stack, stores the stack pointer in *save_sp, and resumes the
// context whose stack pointer is next_sp.
__attribute__((visibility("hidden"))) void sexpgpu_sim_switch(void** save_sp, void* next_sp);
// First code of a new fiber: calls the function held in a callee-saved
// register with the argument held in another (see prepare_stack).
__attribute__((visibility("hidden"))) void sexpgpu_sim_fiber_start();
// The module's dynamic shared memory (`extern __shared__` names alias it).
extern __attribute__((aligned(1024), visibility("hidden"))) thread_local unsigned char sexpgpu_sim_dynamic_shared[];
}

#if defined(__x86_64__)
__asm__(R"(
    .pushsection .text
    .p2align 4
    .globl sexpgpu_sim_switch
    .hidden sexpgpu_sim_switch
    .type sexpgpu_sim_switch, @function
sexpgpu_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size sexpgpu_sim_switch, .-sexpgpu_sim_switch

    .p2align 4
    .globl sexpgpu_sim_fiber_start
    .hidden sexpgpu_sim_fiber_start
    .type sexpgpu_sim_fiber_start, @function
sexpgpu_sim_fiber_start:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%rbx
    ud2
    .cfi_endproc
    .size sexpgpu_sim_fiber_start, .-sexpgpu_sim_fiber_start
    .popsection
)");
#elif defined(__aarch64__)
__asm__(R"(
    .pushsection .text
    .p2align 4
    .globl sexpgpu_sim_switch
    .hidden sexpgpu_sim_switch
    .type sexpgpu_sim_switch, %function
sexpgpu_sim_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mrs x9, fpcr
    str x9, [sp, #160]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldr x9, [sp, #160]
    msr fpcr, x9
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size sexpgpu_sim_switch, .-sexpgpu_sim_switch

    .p2align 4
    .globl sexpgpu_sim_fiber_start
    .hidden sexpgpu_sim_fiber_start
    .type sexpgpu_sim_fiber_start, %function
sexpgpu_sim_fiber_start:
    .cfi_startproc
    .cfi_undefined x30
    mov x0, x19
    blr x20
    brk #0
    .cfi_endproc
    .size sexpgpu_sim_fiber_start, .-sexpgpu_sim_fiber_start
    .popsection
)");
#endif

namespace sexpgpu_sim {

constexpr int kAbiVersion = 1;
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxWarps = kMaxThreads / 32;
// sm_90's opt-in maximum of dynamic shared memory per block.
constexpr size_t kMaxDynamicShared = 232448;
constexpr size_t kSharedCanaryBytes = 256;
// The canaries Python's DeviceMemory puts before and after every buffer.
constexpr size_t kBufferCanaryBytes = 256;
// Read as f32 or as bf16 this is a quiet NaN: uninitialised shared memory and
// canaries show up as NaN in results.
constexpr uint32_t kPoisonWord = 0x7fc57fc5u;

enum ParamKind : int { kPointer = 1, kSigned = 2, kUnsigned = 3, kFloat = 4, kBFloat16 = 5, kBytes = 6 };
struct ParamInfo { int kind, size, align; };
struct KernelInfo {
    int abi;
    const char* name;
    void (*thunk)(void* const* args);
    int nparams;
    const ParamInfo* params;
    unsigned max_threads;  // __launch_bounds__'s first argument, 0 without one
};

enum Schedule : int { kRoundRobin = 0, kWarpAfterWarp = 1 };

// What Python passes to sexpgpu_sim_launch (mirrored by a ctypes Structure).
struct LaunchRequest {
    const KernelInfo* kernel;
    void* const* args;
    unsigned grid[3];
    unsigned block[3];
    uint64_t shared_bytes;
    int schedule;
    unsigned char* stacks;  // stack_count regions of stack_stride bytes; each begins with guard_bytes of PROT_NONE
    uint64_t stack_stride;
    uint64_t guard_bytes;
    uint64_t stack_count;
    const uint64_t* buffers;  // (address, size) of every device buffer, whose canaries are checked after the grid
    uint64_t buffer_count;
};

// Where in the kernel source a thread waits; two barriers are one only at the same site.
struct Site {
    const char* file;
    int line;
    int column;
    bool operator==(const Site& o) const { return line == o.line && column == o.column && strcmp(file, o.file) == 0; }
    bool operator!=(const Site& o) const { return !(*this == o); }
};

enum ThreadState : unsigned char { kRunnable, kAtBarrier, kAtWarpOp, kExited };
enum Op : unsigned char {
    kOpNone, kSyncThreads, kSyncThreadsCount, kSyncThreadsAnd, kSyncThreadsOr, kSyncWarp,
    kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll,
    kReduceAdd, kReduceMinU, kReduceMaxU, kReduceMinI, kReduceMaxI, kReduceAnd, kReduceOr, kReduceXor,
};
inline const char* op_name(Op op) {
    switch (op) {
        case kSyncThreads: return "__syncthreads";
        case kSyncThreadsCount: return "__syncthreads_count";
        case kSyncThreadsAnd: return "__syncthreads_and";
        case kSyncThreadsOr: return "__syncthreads_or";
        case kSyncWarp: return "__syncwarp";
        case kShflIdx: return "__shfl_sync";
        case kShflUp: return "__shfl_up_sync";
        case kShflDown: return "__shfl_down_sync";
        case kShflXor: return "__shfl_xor_sync";
        case kBallot: return "__ballot_sync";
        case kAny: return "__any_sync";
        case kAll: return "__all_sync";
        case kReduceAdd: return "__reduce_add_sync";
        case kReduceMinU: case kReduceMinI: return "__reduce_min_sync";
        case kReduceMaxU: case kReduceMaxI: return "__reduce_max_sync";
        case kReduceAnd: return "__reduce_and_sync";
        case kReduceOr: return "__reduce_or_sync";
        case kReduceXor: return "__reduce_xor_sync";
        default: return "?";
    }
}

struct Thread {
    void* sp;
    uint3 idx;
    unsigned tid;
    ThreadState state;
    Op op;  // what it waits at, and where
    Site site;
    uint32_t mask;  // a warp operation's operands and result
    int src;
    int clamp;
    uint64_t value;
    uint64_t result;
};

struct Warp {
    uint32_t existing;  // lanes the block has (its last warp may be partial)
    uint32_t exited;
    uint32_t runnable;
    uint32_t arrived;  // lanes waiting in the pending exchange
    uint32_t mask_union;
    Op op;
    Site site;
};

struct Runtime {
    const LaunchRequest* req;
    Thread* current;  // the running fiber; null while the scheduler's own context runs
    void* main_sp;
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    unsigned nthreads, nwarps, nexited;
    unsigned barrier_arrived;
    int barrier_votes, barrier_result;
    bool failed;
    char message[4096];
    // Static shared memory is the module's TLS block minus the dynamic area.
    unsigned char* tls_begin;
    unsigned char* tls_end;
    sigjmp_buf fault_jump;
    struct sigaction saved_actions[4];
    stack_t saved_altstack;
};

inline Runtime g;
inline Thread threads[kMaxThreads];
inline Warp warps[kMaxWarps];

// The poison byte at an address: kPoisonWord in every aligned 4-byte word.
inline unsigned char poison_byte(const unsigned char* p) {
    return static_cast<unsigned char>(kPoisonWord >> (8 * (reinterpret_cast<uintptr_t>(p) & 3)));
}
// Both hosts are little-endian: the word's low byte sits at the aligned address.
inline void poison(unsigned char* begin, unsigned char* end) {
    unsigned char* p = begin;
    for (; p < end && (reinterpret_cast<uintptr_t>(p) & 3); ++p) *p = poison_byte(p);
    for (; p + 4 <= end; p += 4) memcpy(p, &kPoisonWord, 4);
    for (; p < end; ++p) *p = poison_byte(p);
}
inline const unsigned char* find_unpoisoned(const unsigned char* begin, const unsigned char* end) {
    const unsigned char* p = begin;
    for (; p < end && (reinterpret_cast<uintptr_t>(p) & 3); ++p)
        if (*p != poison_byte(p)) return p;
    for (; p + 4 <= end; p += 4)
        if (memcmp(p, &kPoisonWord, 4) != 0) break;
    for (; p < end; ++p)
        if (*p != poison_byte(p)) return p;
    return nullptr;
}

// Appends to the text at `out`, never past `end` (a long message is cut short).
__attribute__((format(printf, 3, 4))) inline void append(char*& out, char* end, const char* fmt, ...) {
    if (end - out <= 1) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, end - out, fmt, ap);
    va_end(ap);
    out += n < 0 ? 0 : (n < end - out ? n : end - out - 1);
}

// "threads 0-31, 64-95" for the set `member` selects.
template <class Member>
inline void append_thread_ranges(char*& out, char* end, Member member) {
    bool first = true;
    for (unsigned t = 0; t < g.nthreads; ++t) {
        if (!member(t) || (t > 0 && member(t - 1))) continue;
        unsigned last = t;
        while (last + 1 < g.nthreads && member(last + 1)) ++last;
        if (last == t) append(out, end, "%s%u", first ? "" : ", ", t);
        else append(out, end, "%s%u-%u", first ? "" : ", ", t, last);
        first = false;
    }
}

inline int message_prefix(char* buf, size_t len) {
    const uint3& b = g.block_idx;
    return snprintf(buf, len, "kernel %s, block (%u,%u,%u): ", g.req->kernel->name, b.x, b.y, b.z);
}

__attribute__((noreturn)) inline void to_main(Thread* self) {
    g.current = nullptr;
    sexpgpu_sim_switch(&self->sp, g.main_sp);
    __builtin_unreachable();
}

// Ends the launch with an error; called on a fiber, never returns to it.
__attribute__((noreturn, format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
    int n = message_prefix(g.message, sizeof g.message);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.message + n, sizeof g.message - n, fmt, ap);
    va_end(ap);
    g.failed = true;
    to_main(g.current);
}

inline void describe_thread(char* buf, size_t len, const Thread& t) {
    if (g.block_dim.y == 1 && g.block_dim.z == 1) snprintf(buf, len, "thread %u", t.tid);
    else snprintf(buf, len, "thread %u (%u,%u,%u)", t.tid, t.idx.x, t.idx.y, t.idx.z);
}

// The block cannot go on: say where every thread is, grouped.
__attribute__((noreturn)) inline void fail_stuck(const char* headline) {
    char* out = g.message + message_prefix(g.message, sizeof g.message);
    char* end = g.message + sizeof g.message;
    append(out, end, "%s: ", headline);
    bool grouped[kMaxThreads] = {};
    bool first = true;
    for (unsigned t = 0; t < g.nthreads; ++t) {
        if (grouped[t]) continue;
        const Thread& lead = threads[t];
        auto same = [&](unsigned u) {
            const Thread& o = threads[u];
            if (o.state != lead.state) return false;
            if (lead.state != kAtBarrier && lead.state != kAtWarpOp) return true;
            return o.op == lead.op && o.site == lead.site;
        };
        append(out, end, "%sthreads ", first ? "" : "; ");
        append_thread_ranges(out, end, same);
        for (unsigned u = t; u < g.nthreads; ++u) grouped[u] = grouped[u] || same(u);
        switch (lead.state) {
            case kExited: append(out, end, " have exited"); break;
            default:
                append(out, end, " wait at %s (%s:%d:%d)", op_name(lead.op), lead.site.file, lead.site.line,
                       lead.site.column);
        }
        first = false;
    }
    g.failed = true;
    to_main(g.current);
}

inline Thread* pick_round_robin(unsigned tid) {
    unsigned w = tid >> 5, lane = tid & 31;
    uint32_t later = lane == 31 ? 0u : (warps[w].runnable & (~0u << (lane + 1)));
    if (later) return &threads[(w << 5) + __builtin_ctz(later)];
    for (unsigned k = 1; k <= g.nwarps; ++k) {  // k == nwarps comes back to w's first lanes
        unsigned v = (w + k) % g.nwarps;
        if (warps[v].runnable) return &threads[(v << 5) + __builtin_ctz(warps[v].runnable)];
    }
    return nullptr;
}
inline Thread* highest_lane(unsigned w, uint32_t lanes) { return &threads[(w << 5) + 31 - __builtin_clz(lanes)]; }
inline Thread* pick_warp_after_warp(unsigned tid) {
    unsigned w = tid >> 5, lane = tid & 31;
    if (uint32_t r = warps[w].runnable) {
        uint32_t below = r & ((1u << lane) - 1u);
        return highest_lane(w, below ? below : r);
    }
    for (unsigned k = 1; k < g.nwarps; ++k) {
        unsigned v = (w + g.nwarps - k) % g.nwarps;
        if (warps[v].runnable) return highest_lane(v, warps[v].runnable);
    }
    return nullptr;
}
// Where a schedule starts a block, and starts again after a block barrier.
inline Thread* pick_first() {
    if (g.req->schedule == kRoundRobin) return pick_round_robin(g.nwarps * 32 - 1);
    for (unsigned v = g.nwarps; v-- > 0;)
        if (warps[v].runnable) return highest_lane(v, warps[v].runnable);
    return nullptr;
}
inline Thread* pick_next(const Thread* t) {
    return g.req->schedule == kRoundRobin ? pick_round_robin(t->tid) : pick_warp_after_warp(t->tid);
}

// Hands the OS thread to `next` (or ends or fails the block when nobody can run).
inline void run_next(Thread* self, Thread* next) {
    if (!next) {
        if (g.nexited == g.nthreads) to_main(self);
        bool at_barrier = false;
        for (unsigned t = 0; t < g.nthreads; ++t) at_barrier = at_barrier || threads[t].state == kAtBarrier;
        fail_stuck(at_barrier ? "__syncthreads divergence, not every thread of the block reaches the same barrier"
                              : "warp divergence, lanes wait at a warp operation for lanes that never arrive");
    }
    if (next == self) return;
    g.current = next;
    sexpgpu_sim_switch(&self->sp, next->sp);
}

inline void stop_running(const Thread* t) { warps[t->tid >> 5].runnable &= ~(1u << (t->tid & 31)); }

inline int block_barrier(Op op, int vote, Site site) {
    Thread* self = g.current;
    self->state = kAtBarrier;
    self->op = op;
    self->site = site;
    stop_running(self);
    g.barrier_votes += vote != 0;
    if (++g.barrier_arrived < g.nthreads) {
        run_next(self, pick_next(self));
        return g.barrier_result;
    }
    for (unsigned t = 1; t < g.nthreads; ++t) {
        const Thread& o = threads[t];
        if (o.op != threads[0].op || o.site != threads[0].site)
            fail_stuck("__syncthreads divergence, the threads of the block wait at different barriers");
    }
    g.barrier_result = g.barrier_votes;
    g.barrier_votes = 0;
    g.barrier_arrived = 0;
    for (unsigned t = 0; t < g.nthreads; ++t) threads[t].state = kRunnable;
    for (unsigned w = 0; w < g.nwarps; ++w) warps[w].runnable = warps[w].existing;
    run_next(self, pick_first());
    return g.barrier_result;
}

inline const char* why_not_readable(const Warp& w, unsigned lane) {
    if (!(w.existing >> lane & 1u)) return "does not exist (the block's last warp is partial)";
    if (w.exited >> lane & 1u) return "has exited";
    return "does not take part (it is not in the mask)";
}

// PTX's shfl.sync: which lane `lane` reads, with CUDA's clamp encoding.
inline unsigned shuffle_source(Op op, unsigned lane, int src, int clamp) {
    int b = src & 31, cval = clamp & 31, seg = (clamp >> 8) & 31;
    int i = static_cast<int>(lane), max_lane = (i & seg) | (cval & ~seg), min_lane = i & seg;
    int j = i;
    bool in_range = false;
    switch (op) {
        case kShflUp: j = i - b; in_range = j >= max_lane; break;
        case kShflDown: j = i + b; in_range = j <= max_lane; break;
        case kShflXor: j = i ^ b; in_range = j <= max_lane; break;
        default: j = min_lane | (b & ~seg); in_range = j <= max_lane; break;
    }
    return static_cast<unsigned>(in_range ? j : i);
}

inline void complete_exchange(unsigned wi) {
    Warp& w = warps[wi];
    Thread* lanes = &threads[wi << 5];
    uint32_t votes = 0;
    for (uint32_t m = w.arrived; m; m &= m - 1) {
        unsigned lane = __builtin_ctz(m);
        if (lanes[lane].value) votes |= 1u << lane;
    }
    for (uint32_t m = w.arrived; m; m &= m - 1) {
        unsigned lane = __builtin_ctz(m);
        Thread& t = lanes[lane];
        uint32_t group = t.mask & w.arrived;
        switch (w.op) {
            case kShflIdx: case kShflUp: case kShflDown: case kShflXor: {
                unsigned j = shuffle_source(w.op, lane, t.src, t.clamp);
                if (!(w.arrived >> j & 1u)) {
                    char who[64];
                    describe_thread(who, sizeof who, t);
                    fail("%s (warp %u, lane %u) reads lane %u through %s (%s:%d:%d), but lane %u %s", who, wi, lane,
                         j, op_name(w.op), w.site.file, w.site.line, w.site.column, j, why_not_readable(w, j));
                }
                t.result = lanes[j].value;
                break;
            }
            case kBallot: t.result = votes & t.mask; break;
            case kAny: t.result = (votes & t.mask) != 0; break;
            case kAll: t.result = (group & ~votes) == 0; break;
            case kReduceAdd: case kReduceMinU: case kReduceMaxU: case kReduceMinI: case kReduceMaxI:
            case kReduceAnd: case kReduceOr: case kReduceXor: {
                uint32_t acc = static_cast<uint32_t>(lanes[__builtin_ctz(group)].value);
                for (uint32_t r = group & (group - 1); r; r &= r - 1) {
                    uint32_t v = static_cast<uint32_t>(lanes[__builtin_ctz(r)].value);
                    switch (w.op) {
                        case kReduceAdd: acc += v; break;
                        case kReduceMinU: acc = v < acc ? v : acc; break;
                        case kReduceMaxU: acc = v > acc ? v : acc; break;
                        case kReduceMinI: acc = static_cast<int32_t>(v) < static_cast<int32_t>(acc) ? v : acc; break;
                        case kReduceMaxI: acc = static_cast<int32_t>(v) > static_cast<int32_t>(acc) ? v : acc; break;
                        case kReduceAnd: acc &= v; break;
                        case kReduceOr: acc |= v; break;
                        default: acc ^= v; break;
                    }
                }
                t.result = acc;
                break;
            }
            default: break;
        }
    }
    for (uint32_t m = w.arrived; m; m &= m - 1) lanes[__builtin_ctz(m)].state = kRunnable;
    w.runnable |= w.arrived;
    w.arrived = 0;
    w.mask_union = 0;
}

// The exchange completes when every lane the masks name that has not exited has arrived.
inline void try_complete_exchange(unsigned wi) {
    Warp& w = warps[wi];
    uint32_t required = w.mask_union & w.existing & ~w.exited;
    if (w.arrived && (w.arrived & required) == required) complete_exchange(wi);
}

inline uint64_t warp_op(Op op, uint32_t mask, uint64_t value, int src, int clamp, Site site) {
    Thread* self = g.current;
    unsigned wi = self->tid >> 5, lane = self->tid & 31;
    Warp& w = warps[wi];
    char who[64];
    if (!(mask >> lane & 1u)) {
        describe_thread(who, sizeof who, *self);
        fail("%s (warp %u, lane %u) calls %s (%s:%d:%d) with mask 0x%08x, which does not name its own lane",
             who, wi, lane, op_name(op), site.file, site.line, site.column, mask);
    }
    // __syncwarp may meet at different sites (CUDA allows it); the other operations exchange values, so not.
    if (w.arrived && (w.op != op || (op != kSyncWarp && w.site != site))) {
        describe_thread(who, sizeof who, *self);
        fail("warp divergence in warp %u: lanes 0x%08x wait at %s (%s:%d:%d) while %s (lane %u) arrives at %s (%s:%d:%d)",
             wi, w.arrived, op_name(w.op), w.site.file, w.site.line, w.site.column, who, lane, op_name(op), site.file,
             site.line, site.column);
    }
    if (!w.arrived) {
        w.op = op;
        w.site = site;
    }
    w.arrived |= 1u << lane;
    w.mask_union |= mask;
    stop_running(self);
    self->state = kAtWarpOp;
    self->op = op;
    self->site = site;
    self->mask = mask;
    self->value = value;
    self->src = src;
    self->clamp = clamp;
    try_complete_exchange(wi);
    run_next(self, pick_next(self));
    return self->result;
}

__attribute__((noreturn)) inline void thread_exit(Thread* self) {
    unsigned wi = self->tid >> 5;
    self->state = kExited;
    warps[wi].exited |= 1u << (self->tid & 31);
    stop_running(self);
    ++g.nexited;
    try_complete_exchange(wi);
    run_next(self, pick_next(self));
    __builtin_unreachable();  // nobody resumes an exited fiber: run_next switched away for good
}

inline void fiber_main(Thread* self) {
    g.req->kernel->thunk(g.req->args);
    thread_exit(self);
}

// A new fiber's stack: the frame sexpgpu_sim_switch pops, returning into
// sexpgpu_sim_fiber_start with `self` and fiber_main in callee-saved registers.
inline void* prepare_stack(unsigned char* stack_end, Thread* self) {
    uint64_t* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack_end) & ~uintptr_t(15)) - 2;
    top[0] = top[1] = 0;  // a null return address ends debuggers' backtraces
#if defined(__x86_64__)
    uint64_t* sp = top - 8;  // control words, r15, r14, r13, r12, rbx, rbp, return address
    sp[0] = 0x1f80u | (uint64_t{0x037f} << 32);  // MXCSR and x87 control word at reset: round to nearest, no FTZ
    sp[1] = sp[2] = sp[3] = 0;
    sp[4] = reinterpret_cast<uint64_t>(self);
    sp[5] = reinterpret_cast<uint64_t>(&fiber_main);
    sp[6] = 0;
    sp[7] = reinterpret_cast<uint64_t>(&sexpgpu_sim_fiber_start);
#else
    uint64_t* sp = top - 22;  // x19..x30, d8..d15, fpcr, padding
    memset(sp, 0, 22 * sizeof(uint64_t));
    sp[0] = reinterpret_cast<uint64_t>(self);
    sp[1] = reinterpret_cast<uint64_t>(&fiber_main);
    sp[11] = reinterpret_cast<uint64_t>(&sexpgpu_sim_fiber_start);
#endif
    return sp;
}

inline unsigned char* stack_end(unsigned tid) { return g.req->stacks + (uint64_t{tid} + 1) * g.req->stack_stride; }

inline void run_block(uint3 block_idx) {
    g.block_idx = block_idx;
    g.nexited = 0;
    g.barrier_arrived = 0;
    g.barrier_votes = 0;
    const dim3& bd = g.block_dim;
    for (unsigned t = 0; t < g.nthreads; ++t) {
        Thread& th = threads[t];
        th = Thread{};
        th.tid = t;
        th.idx = uint3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
        th.state = kRunnable;
        th.sp = prepare_stack(stack_end(t), &th);
    }
    for (unsigned w = 0; w < g.nwarps; ++w) {
        unsigned lanes = g.nthreads - w * 32 < 32 ? g.nthreads - w * 32 : 32;
        warps[w] = Warp{};
        warps[w].existing = warps[w].runnable = lanes == 32 ? ~0u : (1u << lanes) - 1u;
    }
    // Shared memory holds garbage when a block starts; NaN garbage shows.
    unsigned char* dyn = sexpgpu_sim_dynamic_shared;
    unsigned char* dyn_end = dyn + kMaxDynamicShared + kSharedCanaryBytes;
    if (g.tls_begin) {
        poison(g.tls_begin, dyn < g.tls_begin ? g.tls_begin : dyn);
        poison(dyn_end > g.tls_begin ? dyn_end : g.tls_begin, g.tls_end);
    }
    poison(dyn, dyn + g.req->shared_bytes + kSharedCanaryBytes);
    Thread* first = pick_first();
    g.current = first;
    sexpgpu_sim_switch(&g.main_sp, first->sp);
    g.current = nullptr;
    if (g.failed) return;
    const unsigned char* canary = dyn + g.req->shared_bytes;
    if (const unsigned char* hit = find_unpoisoned(canary, canary + kSharedCanaryBytes)) {
        int n = message_prefix(g.message, sizeof g.message);
        snprintf(g.message + n, sizeof g.message - n,
                 "wrote past the end of its %llu bytes of dynamic shared memory (at byte %llu)",
                 static_cast<unsigned long long>(g.req->shared_bytes), static_cast<unsigned long long>(hit - dyn));
        g.failed = true;
    }
}

// The calling thread's instance of this module's TLS block (static shared memory).
inline int find_tls_block(struct dl_phdr_info* info, size_t, void* data) {
    Runtime* rt = static_cast<Runtime*>(data);
    unsigned char* here = sexpgpu_sim_dynamic_shared;
    if (!info->dlpi_tls_data) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        unsigned char* begin = static_cast<unsigned char*>(info->dlpi_tls_data);
        if (ph.p_type == PT_TLS && here >= begin && here < begin + ph.p_memsz) {
            rt->tls_begin = begin;
            rt->tls_end = begin + ph.p_memsz;
            return 1;
        }
    }
    return 0;
}

constexpr int kFaultSignals[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
alignas(16) inline unsigned char fault_stack[65536];

inline void on_fault(int sig, siginfo_t* info, void*) {
    int index = 0;
    while (kFaultSignals[index] != sig) ++index;
    if (!g.current) {  // not kernel code: let whoever handled it before see it
        sigaction(sig, &g.saved_actions[index], nullptr);
        return;
    }
    char who[64];
    describe_thread(who, sizeof who, *g.current);
    int n = message_prefix(g.message, sizeof g.message);
    char* out = g.message + n;
    size_t room = sizeof g.message - n;
    uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    // The running fiber's guard page, or below it by up to a stack: a stack
    // probe that stepped over the guard page lands there.
    uintptr_t bottom = reinterpret_cast<uintptr_t>(g.req->stacks) + uint64_t{g.current->tid} * g.req->stack_stride;
    if (sig == SIGSEGV && addr < bottom + g.req->guard_bytes && addr + g.req->stack_stride >= bottom) {
        snprintf(out, room, "%s overflowed its %llu KiB stack (make the simulator's stacks larger)", who,
                 static_cast<unsigned long long>((g.req->stack_stride - g.req->guard_bytes) / 1024));
    } else if (sig == SIGFPE) {
        snprintf(out, room, "%s: arithmetic fault (integer division by zero?)", who);
    } else if (sig == SIGILL) {
        snprintf(out, room, "%s: illegal instruction (a trap, or code the compiler proved unreachable)", who);
    } else {
        snprintf(out, room, "%s: invalid memory access at address 0x%llx", who, static_cast<unsigned long long>(addr));
    }
    g.failed = true;
    g.current = nullptr;
    siglongjmp(g.fault_jump, 1);
}

inline void install_fault_handlers() {
    stack_t alt{};
    alt.ss_sp = fault_stack;
    alt.ss_size = sizeof fault_stack;
    sigaltstack(&alt, &g.saved_altstack);
    struct sigaction act{};
    act.sa_sigaction = on_fault;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    for (int i = 0; i < 4; ++i) sigaction(kFaultSignals[i], &act, &g.saved_actions[i]);
}
inline void restore_fault_handlers() {
    for (int i = 0; i < 4; ++i) sigaction(kFaultSignals[i], &g.saved_actions[i], nullptr);
    sigaltstack(&g.saved_altstack, nullptr);
}

// Runs every block; false with g.message set when the kernel failed.
inline bool run_grid() {
    if (sigsetjmp(g.fault_jump, 1)) return false;
    const LaunchRequest& r = *g.req;
    unsigned count = r.grid[0] * r.grid[1] * r.grid[2];
    for (unsigned i = 0; i < count; ++i) {
        unsigned b = r.schedule == kRoundRobin ? i : count - 1 - i;  // the second schedule also reverses the blocks
        run_block(uint3{b % r.grid[0], (b / r.grid[0]) % r.grid[1], b / (r.grid[0] * r.grid[1])});
        if (g.failed) return false;
    }
    return true;
}

template <class U, bool = std::is_enum<U>::value> struct AsInteger { using type = U; };
template <class U> struct AsInteger<U, true> { using type = std::underlying_type_t<U>; };

template <class T>
constexpr ParamInfo param_info() {
    using U = std::decay_t<T>;
    using I = typename AsInteger<U>::type;
    int kind = std::is_pointer<U>::value                ? kPointer
               : std::is_same<U, __nv_bfloat16>::value  ? kBFloat16
               : std::is_floating_point<U>::value       ? kFloat
               : std::is_integral<I>::value             ? (std::is_signed<I>::value ? kSigned : kUnsigned)
                                                        : kBytes;
    return ParamInfo{kind, static_cast<int>(sizeof(U)), static_cast<int>(alignof(U))};
}

template <class F> struct KernelTraits;
template <class... A>
struct KernelTraits<void (*)(A...)> {
    static constexpr int count = sizeof...(A);
    static const ParamInfo* params() {
        static const ParamInfo info[] = {param_info<A>()..., ParamInfo{0, 0, 0}};
        return info;
    }
    template <void (*F)(A...), size_t... I>
    static void call(void* const* args, std::index_sequence<I...>) {
        F(*static_cast<std::decay_t<A>*>(args[I])...);
    }
};
template <auto F>
void thunk(void* const* args) {
    using Traits = KernelTraits<decltype(F)>;
    Traits::template call<F>(args, std::make_index_sequence<Traits::count>{});
}
template <auto F>
const KernelInfo* describe(const char* name, unsigned max_threads) {
    using Traits = KernelTraits<decltype(F)>;
    static const KernelInfo info{kAbiVersion, name, &thunk<F>, Traits::count, Traits::params(), max_threads};
    return &info;
}
constexpr unsigned first_of() { return 0; }
template <class... Rest>
constexpr unsigned first_of(long long max_threads, Rest...) { return static_cast<unsigned>(max_threads); }

}  // namespace sexpgpu_sim

// ---------------------------------------------------------------------------
// The CUDA built-ins the kernels see
// ---------------------------------------------------------------------------
// Default arguments that the compiler fills in with the caller's position
// (the column tells apart two barriers on one line). Clang has
// __builtin_COLUMN; GCC's C++17 has only __builtin_source_location, which
// fills in the type std::source_location declares from C++20 on.
#if __has_builtin(__builtin_COLUMN)
#define SEXPGPU_SIM_CALLER_COLUMN __builtin_COLUMN()
#elif __cplusplus > 201703L
#include <source_location>
#define SEXPGPU_SIM_CALLER_COLUMN static_cast<int>(std::source_location::current().column())
#else
namespace std {
struct source_location {
    struct __impl {
        const char* _M_file_name;
        const char* _M_function_name;
        unsigned int _M_line;
        unsigned int _M_column;
    };
};
}  // namespace std
#define SEXPGPU_SIM_CALLER_COLUMN \
    static_cast<int>(static_cast<const std::source_location::__impl*>(__builtin_source_location())->_M_column)
#endif
#define SEXPGPU_SIM_CALL_SITE \
    const char *file = __builtin_FILE(), int line = __builtin_LINE(), int column = SEXPGPU_SIM_CALLER_COLUMN
#define SEXPGPU_SIM_SITE (::sexpgpu_sim::Site{file, line, column})

#define threadIdx (static_cast<const uint3&>(::sexpgpu_sim::g.current->idx))
#define blockIdx (static_cast<const uint3&>(::sexpgpu_sim::g.block_idx))
#define blockDim (static_cast<const dim3&>(::sexpgpu_sim::g.block_dim))
#define gridDim (static_cast<const dim3&>(::sexpgpu_sim::g.grid_dim))

inline void __syncthreads(SEXPGPU_SIM_CALL_SITE) {
    sexpgpu_sim::block_barrier(sexpgpu_sim::kSyncThreads, 0, SEXPGPU_SIM_SITE);
}
inline int __syncthreads_count(int p, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::block_barrier(sexpgpu_sim::kSyncThreadsCount, p, SEXPGPU_SIM_SITE);
}
inline int __syncthreads_and(int p, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::block_barrier(sexpgpu_sim::kSyncThreadsAnd, p, SEXPGPU_SIM_SITE) == static_cast<int>(sexpgpu_sim::g.nthreads);
}
inline int __syncthreads_or(int p, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::block_barrier(sexpgpu_sim::kSyncThreadsOr, p, SEXPGPU_SIM_SITE) != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, SEXPGPU_SIM_CALL_SITE) {
    sexpgpu_sim::warp_op(sexpgpu_sim::kSyncWarp, mask, 0, 0, 0, SEXPGPU_SIM_SITE);
}
inline unsigned __activemask() {
    const sexpgpu_sim::Warp& w = sexpgpu_sim::warps[sexpgpu_sim::g.current->tid >> 5];
    return w.existing & ~w.exited;
}

namespace sexpgpu_sim {
template <class T>
inline T shuffle(Op op, unsigned mask, T var, int src, int width, Site site) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "warp shuffles move values of at most 8 bytes");
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail("%s (%s:%d:%d) with width %d, which is not a power of two from 1 to 32", op_name(op), site.file, site.line,
             site.column, width);
    int clamp = ((32 - width) << 8) | (op == kShflUp ? 0 : 0x1f);
    uint64_t bits = 0;
    memcpy(&bits, &var, sizeof(T));
    bits = warp_op(op, mask, bits, src, clamp, site);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace sexpgpu_sim

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::shuffle(sexpgpu_sim::kShflIdx, mask, var, srcLane, width, SEXPGPU_SIM_SITE);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::shuffle(sexpgpu_sim::kShflUp, mask, var, static_cast<int>(delta), width, SEXPGPU_SIM_SITE);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::shuffle(sexpgpu_sim::kShflDown, mask, var, static_cast<int>(delta), width, SEXPGPU_SIM_SITE);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize, SEXPGPU_SIM_CALL_SITE) {
    return sexpgpu_sim::shuffle(sexpgpu_sim::kShflXor, mask, var, laneMask, width, SEXPGPU_SIM_SITE);
}
inline unsigned __ballot_sync(unsigned mask, int p, SEXPGPU_SIM_CALL_SITE) {
    return static_cast<unsigned>(sexpgpu_sim::warp_op(sexpgpu_sim::kBallot, mask, p != 0, 0, 0, SEXPGPU_SIM_SITE));
}
inline int __any_sync(unsigned mask, int p, SEXPGPU_SIM_CALL_SITE) {
    return static_cast<int>(sexpgpu_sim::warp_op(sexpgpu_sim::kAny, mask, p != 0, 0, 0, SEXPGPU_SIM_SITE));
}
inline int __all_sync(unsigned mask, int p, SEXPGPU_SIM_CALL_SITE) {
    return static_cast<int>(sexpgpu_sim::warp_op(sexpgpu_sim::kAll, mask, p != 0, 0, 0, SEXPGPU_SIM_SITE));
}
#define SEXPGPU_SIM_REDUCE(name, T, op)                                                                      \
    inline T name(unsigned mask, T value, SEXPGPU_SIM_CALL_SITE) { \
        return static_cast<T>(sexpgpu_sim::warp_op(op, mask, static_cast<uint32_t>(value), 0, 0, SEXPGPU_SIM_SITE)); \
    }
SEXPGPU_SIM_REDUCE(__reduce_add_sync, unsigned, sexpgpu_sim::kReduceAdd)
SEXPGPU_SIM_REDUCE(__reduce_add_sync, int, sexpgpu_sim::kReduceAdd)
SEXPGPU_SIM_REDUCE(__reduce_min_sync, unsigned, sexpgpu_sim::kReduceMinU)
SEXPGPU_SIM_REDUCE(__reduce_min_sync, int, sexpgpu_sim::kReduceMinI)
SEXPGPU_SIM_REDUCE(__reduce_max_sync, unsigned, sexpgpu_sim::kReduceMaxU)
SEXPGPU_SIM_REDUCE(__reduce_max_sync, int, sexpgpu_sim::kReduceMaxI)
SEXPGPU_SIM_REDUCE(__reduce_and_sync, unsigned, sexpgpu_sim::kReduceAnd)
SEXPGPU_SIM_REDUCE(__reduce_or_sync, unsigned, sexpgpu_sim::kReduceOr)
SEXPGPU_SIM_REDUCE(__reduce_xor_sync, unsigned, sexpgpu_sim::kReduceXor)
#undef SEXPGPU_SIM_REDUCE

// ---------------------------------------------------------------------------
// nvcuda::wmma (<mma.h>): warp-wide 16x16x16 matrix products with bf16 inputs
// and f32 accumulators, the subset the kernels use (fill_fragment,
// load_matrix_sync of matrix_a and matrix_b, store_matrix_sync of an
// accumulator, mma_sync). As on the device, a fragment is held by the warp:
// each lane holds 8 of its 256 elements, and every operation is computed by
// the warp's lanes, each doing its own elements. Which elements a lane holds
// is cuda-sim's choice (lane l holds elements 8l to 8l+7 in row-major order):
// CUDA leaves it unspecified, so a kernel must not depend on it. mma_sync
// stages both inputs for the warp and each lane adds, for each of its
// elements, the 16 products to the accumulator's value in order of k, each
// sum rounded to f32 (the products of bf16 inputs are exact in f32); the
// tensor cores add in an order of their own, so the device's results may
// differ from these in the last bits of f32.
// ---------------------------------------------------------------------------
namespace sexpgpu_sim {
constexpr int kFragmentSide = 16;
constexpr int kFragmentElements = kFragmentSide * kFragmentSide / 32;
// Each warp's inputs of the mma_sync in progress, for all its lanes to read.
inline thread_local float mma_stage[kMaxWarps][2][kFragmentSide * kFragmentSide];
inline unsigned fragment_index(unsigned lane, int i) { return lane * kFragmentElements + static_cast<unsigned>(i); }
}  // namespace sexpgpu_sim

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "cuda-sim emulates wmma's 16x16x16 shape only");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                                                        : std::is_same<T, __nv_bfloat16>::value,
                  "cuda-sim emulates bf16 matrix_a and matrix_b fragments and f32 accumulators");
    enum { num_elements = sexpgpu_sim::kFragmentElements };
    T x[num_elements];
};

template <class Use, class T, class Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, T value) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = value;
}

// Element (row, col) of a matrix_a (row x k) or matrix_b (k x col) fragment is at row * ldm + col in a
// row_major one and at col * ldm + row in a col_major one.
template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p,
                             unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "cuda-sim loads matrix_a and matrix_b fragments only");
    __syncwarp();
    unsigned lane = sexpgpu_sim::g.current->tid & 31;
    for (int i = 0; i < f.num_elements; ++i) {
        unsigned e = sexpgpu_sim::fragment_index(lane, i), row = e / 16, col = e % 16;
        f.x[i] = std::is_same<Layout, row_major>::value ? p[row * ldm + col] : p[col * ldm + row];
    }
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
    __syncwarp();
    unsigned lane = sexpgpu_sim::g.current->tid & 31;
    for (int i = 0; i < f.num_elements; ++i) {
        unsigned e = sexpgpu_sim::fragment_index(lane, i), row = e / 16, col = e % 16;
        (layout == mem_row_major ? p[row * ldm + col] : p[col * ldm + row]) = f.x[i];
    }
}

template <class LayoutA, class LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    unsigned tid = sexpgpu_sim::g.current->tid, lane = tid & 31;
    float (&stage)[2][256] = sexpgpu_sim::mma_stage[tid >> 5];
    __syncwarp();  // every lane is done reading the last product's inputs
    for (int i = 0; i < a.num_elements; ++i) {
        stage[0][sexpgpu_sim::fragment_index(lane, i)] = static_cast<float>(a.x[i]);
        stage[1][sexpgpu_sim::fragment_index(lane, i)] = static_cast<float>(b.x[i]);
    }
    __syncwarp();
    float out[sexpgpu_sim::kFragmentElements];
    for (int i = 0; i < c.num_elements; ++i) {
        unsigned e = sexpgpu_sim::fragment_index(lane, i), row = e / 16, col = e % 16;
        float sum = c.x[i];
        for (unsigned k = 0; k < 16; ++k) sum += stage[0][row * 16 + k] * stage[1][k * 16 + col];
        out[i] = sum;
    }
    for (int i = 0; i < d.num_elements; ++i) d.x[i] = out[i];
}
}  // namespace wmma
}  // namespace nvcuda

__attribute__((noreturn)) inline void __trap(SEXPGPU_SIM_CALL_SITE) {
    char who[64];
    sexpgpu_sim::describe_thread(who, sizeof who, *sexpgpu_sim::g.current);
    sexpgpu_sim::fail("%s: __trap() (%s:%d:%d)", who, file, line, column);
}

// A failed assert() in a kernel fails the launch instead of aborting the
// process (this definition binds the module's calls to glibc's assert hook).
extern "C" __attribute__((visibility("hidden"), noreturn)) void __assert_fail(
    const char* expr, const char* file, unsigned int line, const char* function) noexcept {
    if (!sexpgpu_sim::g.current) {
        fprintf(stderr, "%s:%u: %s: assertion `%s' failed\n", file, line, function, expr);
        abort();
    }
    char who[64];
    sexpgpu_sim::describe_thread(who, sizeof who, *sexpgpu_sim::g.current);
    sexpgpu_sim::fail("%s: assertion `%s` failed (%s:%u)", who, expr, file, line);
}

// ---------------------------------------------------------------------------
// Entry points the Python side calls (the export section names the kernels)
// ---------------------------------------------------------------------------
extern "C" {
__attribute__((aligned(1024), visibility("hidden"))) thread_local unsigned char
    sexpgpu_sim_dynamic_shared[sexpgpu_sim::kMaxDynamicShared + sexpgpu_sim::kSharedCanaryBytes];

__attribute__((visibility("default"))) int sexpgpu_sim_abi_version() { return sexpgpu_sim::kAbiVersion; }

// Runs a whole grid. Returns 0; or 1 with a message naming the kernel, the
// block and what went wrong written to `error`; or 2 when the grid ran but a
// buffer's canary changed (Python says which and where).
__attribute__((visibility("default"))) int sexpgpu_sim_launch(
    const sexpgpu_sim::LaunchRequest* req, char* error, size_t error_len) {
    using namespace sexpgpu_sim;
    g.req = req;
    g.current = nullptr;
    g.failed = false;
    g.message[0] = 0;
    g.grid_dim = dim3(req->grid[0], req->grid[1], req->grid[2]);
    g.block_dim = dim3(req->block[0], req->block[1], req->block[2]);
    g.nthreads = req->block[0] * req->block[1] * req->block[2];
    g.nwarps = (g.nthreads + 31) / 32;
    if (g.nthreads == 0 || g.nthreads > kMaxThreads || g.nthreads > req->stack_count ||
        req->shared_bytes > kMaxDynamicShared || req->kernel->abi != kAbiVersion) {
        snprintf(error, error_len, "kernel %s: bad launch request (%u threads, %llu stacks, %llu bytes of shared memory)",
                 req->kernel->name, g.nthreads, static_cast<unsigned long long>(req->stack_count),
                 static_cast<unsigned long long>(req->shared_bytes));
        return 1;
    }
    sexpgpu_sim_dynamic_shared[0] = 0;  // allocates this OS thread's TLS block, so it can be found
    g.tls_begin = g.tls_end = nullptr;
    dl_iterate_phdr(find_tls_block, &g);
    install_fault_handlers();
    bool ok = run_grid();
    restore_fault_handlers();
    fflush(stdout);
    snprintf(error, error_len, "%s", ok ? "" : g.message);
    if (!ok) return 1;
    for (uint64_t i = 0; i < req->buffer_count; ++i) {
        unsigned char* start = reinterpret_cast<unsigned char*>(req->buffers[2 * i]);
        unsigned char* end = start + req->buffers[2 * i + 1];
        if (find_unpoisoned(start - kBufferCanaryBytes, start) || find_unpoisoned(end, end + kBufferCanaryBytes)) return 2;
    }
    return 0;
}
}

#define SEXPGPU_SIM_EXPORT_KERNEL(name, ...)                                                             \
    extern "C" __attribute__((visibility("default"))) const ::sexpgpu_sim::KernelInfo* sexpgpu_sim_kernel_##name() { \
        return ::sexpgpu_sim::describe<&name>(#name, ::sexpgpu_sim::first_of(__VA_ARGS__));             \
    }
#define SEXPGPU_SIM_EXTERN_SHARED(name)                                                                   \
    extern thread_local unsigned char sexpgpu_sim_extern_shared_##name[] __asm__(#name)                  \
        __attribute__((alias("sexpgpu_sim_dynamic_shared"), visibility("hidden")));

#pragma GCC visibility pop

#endif  // SEXPGPU_CUDA_SIM_H
