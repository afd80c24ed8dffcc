// cuda_math.cuh: device helpers shared by the CUDA kernels: the compute dtype T (float,
// __nv_bfloat16 or __half) read and written as float, 16-byte vector loads/stores, warp and
// block reductions in a fixed order, and small host-side launch helpers.
//
// Kernels do their math in fp32 registers whatever T is; bf16 and fp16 values are widened
// exactly (every bf16 and fp16 value is an fp32 value) and narrowed with round-to-nearest-even.
// fp16's narrowing overflows to inf past 65504 (never saturates): the trainer's loss scaling
// detects an overflowed gradient by its inf.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/cuda/cuda_backend.h"

// ---------------------------------------------------------------- host side

static inline cudaStream_t cu_stream(void) {
    return (cudaStream_t)cuda_stream();
}

static inline bool cu_aligned16(const void *p) {
    return ((uintptr_t)p & 15) == 0;
}

static inline unsigned cu_ceil_div(size_t a, size_t b) {
    return (unsigned)((a + b - 1) / b);
}

// ---------------------------------------------------------------- scalar conversions

__device__ __forceinline__ float to_float(float x) {
    return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
    return __half2float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x); // cvt.rn.f16.f32: past the largest finite value, +-inf
}

// The 16-bit types (two to a 32-bit register: ldmatrix, mma.sync, the 16-byte vectors).
template <typename T> constexpr bool kIs16Bit = sizeof(T) == 2;
__device__ __forceinline__ uint16_t bits16(__nv_bfloat16 x) {
    return __bfloat16_as_ushort(x);
}
__device__ __forceinline__ uint16_t bits16(__half x) {
    return __half_as_ushort(x);
}
// The value of 16 bits of T, exactly: bf16 bits are the high half of the fp32 bits.
template <typename T> __device__ __forceinline__ float from_bits16(uint32_t b);
template <> __device__ __forceinline__ float from_bits16<__nv_bfloat16>(uint32_t b) {
    return __uint_as_float(b << 16);
}
template <> __device__ __forceinline__ float from_bits16<__half>(uint32_t b) {
    return __half2float(__ushort_as_half((unsigned short)b));
}

// The same formula as cpu_sigmoidf (with the exact expf rather than the CPU's polynomial).
__device__ __forceinline__ float sigmoidf_(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// ---------------------------------------------------------------- 16-byte vectors

// Elements of T in one 16-byte load: 4 floats or 8 bf16 / fp16.
template <typename T> constexpr int kPack = 16 / (int)sizeof(T);

__device__ __forceinline__ void load16(const float *p, float *o) {
    float4 v = *reinterpret_cast<const float4 *>(p);
    o[0] = v.x;
    o[1] = v.y;
    o[2] = v.z;
    o[3] = v.w;
}
__device__ __forceinline__ void store16(float *p, const float *o) {
    *reinterpret_cast<float4 *>(p) = make_float4(o[0], o[1], o[2], o[3]);
}
// 8 bf16 or fp16, widened exactly. Little endian: the element at the lower address is the
// low half of each 32-bit word.
template <typename T> __device__ __forceinline__ void load16(const T *p, float *o) {
    static_assert(kIs16Bit<T>, "16-bit element types only");
    uint4 v = *reinterpret_cast<const uint4 *>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        o[2 * k] = from_bits16<T>(w[k] & 0xffffu);
        o[2 * k + 1] = from_bits16<T>(w[k] >> 16);
    }
}
// Two floats rounded to T in one register, lo in the low half (the lower address or index).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return (uint32_t)bits16(from_float<T>(lo)) | ((uint32_t)bits16(from_float<T>(hi)) << 16);
}
template <typename T> __device__ __forceinline__ void store16(T *p, const float *o) {
    static_assert(kIs16Bit<T>, "16-bit element types only");
    uint4 v;
    v.x = pack2<T>(o[0], o[1]);
    v.y = pack2<T>(o[2], o[3]);
    v.z = pack2<T>(o[4], o[5]);
    v.w = pack2<T>(o[6], o[7]);
    *reinterpret_cast<uint4 *>(p) = v;
}

// VEC consecutive elements at p as floats: VEC == 1 (scalar, any alignment) or a multiple
// of kPack<T> (p must then be 16-byte aligned).
template <typename T, int VEC> __device__ __forceinline__ void load_vec(const T *p, float *o) {
    if constexpr (VEC == 1) {
        o[0] = to_float(p[0]);
    } else {
        static_assert(VEC % kPack<T> == 0, "VEC must be 1 or a multiple of the 16-byte pack");
#pragma unroll
        for (int k = 0; k < VEC; k += kPack<T>)
            load16(p + k, o + k);
    }
}
template <typename T, int VEC> __device__ __forceinline__ void store_vec(T *p, const float *o) {
    if constexpr (VEC == 1) {
        p[0] = from_float<T>(o[0]);
    } else {
        static_assert(VEC % kPack<T> == 0, "VEC must be 1 or a multiple of the 16-byte pack");
#pragma unroll
        for (int k = 0; k < VEC; k += kPack<T>)
            store16(p + k, o + k);
    }
}

// ---------------------------------------------------------------- reductions
// Fixed order, so deterministic. Butterfly (xor) shuffles pair the same two values on both
// lanes of each exchange; with a commutative op every lane ends with the same bits.
// Block sizes must be multiples of 32 (full warps) for these.

struct SumOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const {
        return a + b;
    }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const {
        return fmaxf(a, b);
    }
};

template <typename V, typename Op> __device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    return warp_reduce(v, SumOp());
}

// Reduces v over the block; every thread gets the result. Must be reached by every thread
// of the block. The leading barrier lets a kernel call it several times in a row (the
// shared slots are rewritten only after every warp has read the previous result).
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, Op op, V identity) {
    __shared__ V partial[32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < nwarps ? partial[lane] : identity;
    return warp_reduce(v, op);
}
