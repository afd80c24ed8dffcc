// emu.h: a host (CPU) emulation of the CUDA subset that the kernels of engine/cuda/ use, so
// their real source compiles as C++ and runs without a GPU or the CUDA toolkit (the test
// test_cuda_emu, tests/cuda_emu.cmake). Force-included (-include) before every file that
// tests/cuda_emu/gen.py generates from an engine/cuda/*.cu; the stub <cuda_runtime.h>,
// <cuda_bf16.h> and <cuda_fp16.h> (stub_include/) include it too.
//
// Model: one CUDA thread = one fiber (ucontext) on the calling OS thread. Blocks run one
// after another; within a block the scheduler (emu.cpp) runs each thread until it ends or
// reaches __syncthreads / a warp-collective operation (shuffle, ldmatrix, mma.sync), and
// releases a barrier once every thread (warp lane) it waits for has arrived. Single-threaded
// and deterministic, and strict where CUDA says "undefined": a __syncthreads that some
// threads of the block skipped (exited), a warp-collective operation with exited lanes, or a
// deadlock abort with the launch site named.
// __shared__ variables become function statics (one block runs at a time); they are not
// reset between blocks, so a read of shared memory that the block never wrote goes unseen.
// Dynamic (extern __shared__) memory is one buffer of the launch's size, filled with 0xff
// bytes (NaN as bf16, fp16, float and double) at each block's start, with an unmapped page
// after it.
//
// Inline PTX: gen.py turns each asm statement of a known instruction into a call of its
// emu::ptx function (below): ldmatrix .x4 (and .trans), mma.sync m16n8k16 bf16 or f16 -> fp32
// (mma.cpp: the fragment layouts), cp.async 4/8/16 bytes with commit_group / wait_group
// (emu.cpp: a copy lands in shared memory only at the wait_group that completes it).
// What it cannot express: other PTX, atomics, textures: files that use them are not emulated.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <array>
#include <tuple>
#include <utility>

// ---------------------------------------------------------------- keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static

// ---------------------------------------------------------------- vector types
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) int2 {
    int x, y;
};
inline float4 make_float4(float x, float y, float z, float w) {
    return {x, y, z, w};
}
inline float2 make_float2(float x, float y) {
    return {x, y};
}
inline int2 make_int2(int x, int y) {
    return {x, y};
}
constexpr int warpSize = 32;

// ---------------------------------------------------------------- runtime API subset
typedef struct CUstream_st *cudaStream_t;
typedef int cudaError_t;
enum : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
};
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
// Host memory stands for device memory; the copy happens at once (the emulated stream runs
// every kernel to completion at its launch). A stream other than cuda_stream() is an error.
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = 0);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaGetLastError(void); // returns the sticky launch error and clears it
const char *cudaGetErrorString(cudaError_t e);

// ---------------------------------------------------------------- bf16 (cuda_bf16.h)
// __nv_bfloat16 as its 16 bits; conversions as CUDA's: float -> bf16 rounds to nearest even
// (NaN -> canonical 0x7fff), bf16 -> float is exact.
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    inline __nv_bfloat16(float f);
    inline operator float() const;
};
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.__x = 0x7fff;
    } else {
        u += 0x7fffu + ((u >> 16) & 1u); // round to nearest, ties to even
        b.__x = (unsigned short)(u >> 16);
    }
    return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    return __float2bfloat16_rn(f);
}
inline float __bfloat162float(__nv_bfloat16 b) {
    return __uint_as_float((unsigned)b.__x << 16);
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) {
    return b.__x;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 b;
    b.__x = u;
    return b;
}
inline __nv_bfloat16::__nv_bfloat16(float f) : __x(__float2bfloat16_rn(f).__x) {}
inline __nv_bfloat16::operator float() const {
    return __bfloat162float(*this);
}

// ---------------------------------------------------------------- fp16 (cuda_fp16.h)
// __half as its 16 bits (IEEE binary16: 1 sign, 5 exponent, 10 fraction bits); conversions as
// CUDA's: float -> fp16 rounds to nearest even, with overflow to +-inf (at and past 65520,
// halfway from the largest finite 65504 to 2^16) and gradual underflow to subnormals (steps
// of 2^-24), NaN -> canonical 0x7fff; fp16 -> float is exact.
struct __half {
    unsigned short __x;
    __half() = default;
    inline __half(float f);
    inline operator float() const;
};
inline __half __float2half_rn(float f) {
    const unsigned u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    unsigned h;
    if (a > 0x7f800000u) {
        h = 0x7fffu;
    } else if (a >= 0x477ff000u) { // |f| >= 65520 (inf too): inf
        h = sign | 0x7c00u;
    } else if (a >= 0x38800000u) { // |f| >= 2^-14: normal; drop 13 fraction bits
        unsigned r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23); // rebias 127 -> 15
        h = sign | (r >> 13);      // a carry out of the fraction bumps the exponent, as it should
    } else if (a >= 0x33000000u) { // 2^-25 <= |f| < 2^-14: subnormal, m * 2^-24
        const unsigned e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        const unsigned shift = 126 - e; // f = m * 2^(e - 150): m >> (126 - e) units of 2^-24
        const unsigned q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        h = sign | (q + (rest > half || (rest == half && (q & 1u))));
    } else { // below 2^-25: zero (2^-25 itself, the tie, goes to the even 0 above)
        h = sign;
    }
    __half r;
    r.__x = (unsigned short)h;
    return r;
}
inline __half __float2half(float f) {
    return __float2half_rn(f);
}
inline float __half2float(__half h) {
    const unsigned sign = (unsigned)(h.__x & 0x8000u) << 16, e = (h.__x >> 10) & 0x1fu,
                   m = h.__x & 0x3ffu;
    if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13)); // inf, NaN
    if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 0x1p-24f; // subnormal (or zero): exact, m < 2^10
    return sign ? -v : v;
}
inline unsigned short __half_as_ushort(__half h) {
    return h.__x;
}
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
inline __half::__half(float f) : __x(__float2half_rn(f).__x) {}
inline __half::operator float() const {
    return __half2float(*this);
}

// ---------------------------------------------------------------- math intrinsics
// The _rn forms are one IEEE operation each and never fuse into an FMA (the generated
// files are compiled with -ffp-contract=fast to mimic nvcc's default --fmad=true, so plain
// a*b+c may fuse there, as on the GPU; a volatile store ends each of these).
inline float __fadd_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
inline float __fsub_rn(float a, float b) {
    volatile float r = a - b;
    return r;
}
inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
inline float __fdiv_rn(float a, float b) {
    volatile float r = a / b;
    return r;
}
inline float __fsqrt_rn(float a) {
    volatile float r = sqrtf(a);
    return r;
}
inline double __dadd_rn(double a, double b) {
    volatile double r = a + b;
    return r;
}
inline double __dsub_rn(double a, double b) {
    volatile double r = a - b;
    return r;
}
inline double __dmul_rn(double a, double b) {
    volatile double r = a * b;
    return r;
}
inline float __fmaf_rn(float a, float b, float c) {
    return fmaf(a, b, c);
}
// CUDA's integer min/max overloads (the kernels use the int ones).
inline int min(int a, int b) {
    return a < b ? a : b;
}
inline int max(int a, int b) {
    return a > b ? a : b;
}

// ---------------------------------------------------------------- the emulator (emu.cpp)
namespace emu {

extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;

// Aborts with the message, naming the launch, block and thread (the one running, if any).
[[noreturn]] void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

void syncthreads();
int syncthreads_or(int pred); // the OR over the block's threads of their pred
// A warp-collective operation: every lane of the warp calls warp_collective with the same
// `compute` and its own operands `in` and result buffer `out`; once all 32 have arrived,
// compute runs once with the lanes' pointers (indexed by lane) and fills every lane's out.
// `what` names the operation in errors (lanes that exited, lanes at different operations).
typedef void (*WarpCompute)(const void *const in[32], void *const out[32]);
void warp_collective(const char *what, WarpCompute compute, const void *in, void *out);
// A warp-wide exchange: every lane of the warp gives `bytes` (1, 2, 4 or 8) bytes from `in`
// and a source lane; once all have arrived, each gets its source lane's bytes in `out`.
void warp_exchange(unsigned mask, const void *in, void *out, int bytes, int src_lane);
void syncwarp(unsigned mask);
int lane(); // the calling thread's lane: its linear index in the block, mod 32

// The running block's dynamic shared memory (extern __shared__, gen.py), 16-byte aligned.
void *dynamic_shared();
// The shared-window address of p (__cvta_generic_to_shared): its offset in the dynamic
// shared memory; p outside it is an error.
uint32_t shared_address(const void *p);
// The bytes [addr, addr+bytes) of the shared window, for `what`; outside it is an error.
unsigned char *shared_at(uint32_t addr, size_t bytes, const char *what);

// Runs blocks, and the threads of a block, in reverse order from now on (a kernel whose
// result depends on the order has a race); the default is forward.
void set_reverse(bool on);
struct Stats {
    unsigned long long launches, threads, switches, barriers;
};
const Stats &stats_now();

// One launch: the configuration as written at the launch site `file:line`.
struct Config {
    const char *file;
    int line;
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
};
inline Config config(const char *file, int line, dim3 grid, dim3 block, size_t shmem = 0,
                     cudaStream_t stream = 0) {
    return {file, line, grid, block, shmem, stream};
}
// A kernel's identity (for its attributes), whatever its parameters.
typedef void (*KernelId)();
template <typename... P> KernelId kernel_id(void (*kernel)(P...)) {
    return reinterpret_cast<KernelId>(kernel);
}
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
cudaError_t set_max_dynamic_shared(KernelId kernel, int bytes);
// Runs invoke(closure) once per thread of every block of c (or records a launch error).
void launch(const Config &c, KernelId kernel, void (*invoke)(void *), void *closure);

// `kernel<<<cfg>>>(args)`, rewritten by gen.py as `kernel | config(cfg) | args(args)`.
template <typename... P> struct Bound {
    void (*kernel)(P...);
    Config cfg;
};
template <typename... A> struct Args { std::tuple<A...> values; };
template <typename... A> Args<A...> args(A... a) {
    return {std::tuple<A...>(a...)};
}
template <typename... P> Bound<P...> operator|(void (*kernel)(P...), Config c) {
    return {kernel, c};
}
template <typename... P, typename... A> void operator|(Bound<P...> b, Args<A...> a) {
    static_assert(sizeof...(P) == sizeof...(A), "kernel launch: wrong number of arguments");
    // Converted once to the parameter types, as the launch does; each thread then gets its
    // own copy (kernel parameters are per-thread values).
    struct Closure {
        void (*kernel)(P...);
        std::tuple<P...> params;
    } closure{b.kernel, std::make_from_tuple<std::tuple<P...>>(a.values)};
    launch(
        b.cfg, kernel_id(b.kernel),
        [](void *p) {
            Closure *c = static_cast<Closure *>(p);
            std::apply(c->kernel, c->params);
        },
        &closure);
}

// The inline PTX that gen.py translates: each asm statement becomes one call, the opcode's
// optional qualifiers first (as bools), then the instruction's operands in PTX order, the
// destination registers as pointers. Every one is checked as the hardware requires
// (alignment, the shared window, full warps) and fails naming the launch.
namespace ptx {
// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 {d0..d3}, [addr] (mma.cpp).
void ldmatrix_x4(bool trans, std::array<uint32_t *, 4> d, uint32_t addr);
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16.bf16,f16.f16}.f32 {d0..d3}, {a0..a3},
// {b0,b1}, {c0..c3}: f16 true for the .f16 operands (mma.cpp).
void mma_m16n8k16_f32(bool f16, std::array<float *, 4> d, std::array<uint32_t, 4> a,
                      std::array<uint32_t, 2> b, std::array<float, 4> c);
// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size (emu.cpp).
void cp_async(bool cg, uint32_t dst, uint64_t src, int cp_size, uint32_t src_size);
void cp_async_commit_group();
void cp_async_wait_group(int n);
} // namespace ptx

} // namespace emu

// ---------------------------------------------------------------- built-ins
#define threadIdx (static_cast<const uint3 &>(::emu::thread_idx))
#define blockIdx (static_cast<const uint3 &>(::emu::block_idx))
#define blockDim (static_cast<const dim3 &>(::emu::block_dim))
#define gridDim (static_cast<const dim3 &>(::emu::grid_dim))

inline void __syncthreads() {
    emu::syncthreads();
}
inline int __syncthreads_or(int pred) {
    return emu::syncthreads_or(pred);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::syncwarp(mask);
}
template <typename V> V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32) {
    static_assert(sizeof(V) <= 8, "shuffles move at most 8 bytes");
    if (width != 32) __builtin_trap(); // not used by the kernels; not emulated
    V r;
    emu::warp_exchange(mask, &v, &r, (int)sizeof(V), (emu::lane() ^ lane_mask) & 31);
    return r;
}
template <typename V> V __shfl_sync(unsigned mask, V v, int src_lane, int width = 32) {
    static_assert(sizeof(V) <= 8, "shuffles move at most 8 bytes");
    if (width != 32) __builtin_trap();
    V r;
    emu::warp_exchange(mask, &v, &r, (int)sizeof(V), src_lane & 31);
    return r;
}
// sm_80's redux.sync as a butterfly of shuffles: the same result, min being exact.
inline int __reduce_min_sync(unsigned mask, int v) {
    for (int o = 16; o > 0; o >>= 1)
        v = min(v, __shfl_xor_sync(mask, v, o));
    return v;
}
inline size_t __cvta_generic_to_shared(const void *p) {
    return emu::shared_address(p);
}

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    return attr == cudaFuncAttributeMaxDynamicSharedMemorySize
               ? emu::set_max_dynamic_shared(emu::kernel_id(kernel), value)
               : cudaErrorInvalidValue;
}
