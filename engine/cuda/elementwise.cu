// elementwise.cu: SwiGLU, the sigmoid gate of gated attention, and the dtype conversions
// (fp32 -> compute dtype on the device, compute dtype -> fp32 to the host) (CUDA).
//
// Formulas as engine/cpu/elementwise.c. Each output element is written by one thread, so
// every op is deterministic. Rows or arrays that are whole 16-byte vectors with aligned
// buffers take the vector path (VEC elements a thread), the rest the scalar one (VEC 1).
#include <string.h>

#include <type_traits>

#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxFlatBlocks = 1u << 20; // flat kernels loop beyond this many blocks

// ---------------------------------------------------------------- swiglu

// h: (N, 2FF) = [up | gate] per row; out: (N,FF) = up * silu(gate). Grid (N rows, chunks
// of kThreads*VEC columns).
template <typename T, int VEC> __global__ void swiglu_fwd_kernel(T *out, const T *h, int FF) {
    int i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (i >= FF) return;
    const T *up = h + (size_t)blockIdx.x * 2 * FF, *gate = up + FF;
    float u[VEC], g[VEC], o[VEC];
    load_vec<T, VEC>(up + i, u);
    load_vec<T, VEC>(gate + i, g);
#pragma unroll
    for (int k = 0; k < VEC; k++)
        o[k] = u[k] * g[k] * sigmoidf_(g[k]);
    store_vec<T, VEC>(out + (size_t)blockIdx.x * FF + i, o);
}

// dh: (N, 2FF) = [dup | dgate] from dout: (N,FF).
template <typename T, int VEC>
__global__ void swiglu_bwd_kernel(T *dh, const T *dout, const T *h, int FF) {
    int i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (i >= FF) return;
    size_t row = (size_t)blockIdx.x * 2 * FF;
    const T *up = h + row, *gate = up + FF;
    T *dup = dh + row, *dgate = dup + FF;
    float u[VEC], g[VEC], d[VEC], du[VEC], dg[VEC];
    load_vec<T, VEC>(up + i, u);
    load_vec<T, VEC>(gate + i, g);
    load_vec<T, VEC>(dout + (size_t)blockIdx.x * FF + i, d);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        float s = sigmoidf_(g[k]);
        du[k] = d[k] * g[k] * s;
        // d silu(g)/dg = s * (1 + g * (1 - s))
        dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
    }
    store_vec<T, VEC>(dup + i, du);
    store_vec<T, VEC>(dgate + i, dg);
}

template <typename T> void swiglu_fwd(void *out, const void *h, int N, int FF) {
    if (N <= 0 || FF <= 0) return;
    constexpr int V = kPack<T>;
    if (FF % V == 0 && cu_aligned16(out) && cu_aligned16(h)) {
        dim3 grid(N, cu_ceil_div(FF / V, kThreads));
        swiglu_fwd_kernel<T, V><<<grid, kThreads, 0, cu_stream()>>>((T *)out, (const T *)h, FF);
    } else {
        dim3 grid(N, cu_ceil_div(FF, kThreads));
        swiglu_fwd_kernel<T, 1><<<grid, kThreads, 0, cu_stream()>>>((T *)out, (const T *)h, FF);
    }
    CUDA_CHECK(cudaGetLastError());
}

template <typename T> void swiglu_bwd(void *dh, const void *dout, const void *h, int N, int FF) {
    if (N <= 0 || FF <= 0) return;
    constexpr int V = kPack<T>;
    if (FF % V == 0 && cu_aligned16(dh) && cu_aligned16(dout) && cu_aligned16(h)) {
        dim3 grid(N, cu_ceil_div(FF / V, kThreads));
        swiglu_bwd_kernel<T, V>
            <<<grid, kThreads, 0, cu_stream()>>>((T *)dh, (const T *)dout, (const T *)h, FF);
    } else {
        dim3 grid(N, cu_ceil_div(FF, kThreads));
        swiglu_bwd_kernel<T, 1>
            <<<grid, kThreads, 0, cu_stream()>>>((T *)dh, (const T *)dout, (const T *)h, FF);
    }
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- flat (n) kernels

// Blocks for `items` work items, one a thread; kernels loop with a grid stride beyond.
unsigned flat_blocks(size_t items) {
    size_t blocks = (items + kThreads - 1) / kThreads;
    return blocks < kMaxFlatBlocks ? (unsigned)blocks : kMaxFlatBlocks;
}

// The vector path needs n a whole number of vectors and every buffer 16-byte aligned.
bool flat_vectorisable(size_t n, int vec, const void *a, const void *b, const void *c = NULL,
                       const void *d = NULL, const void *e = NULL) {
    return n % vec == 0 && cu_aligned16(a) && cu_aligned16(b) && (!c || cu_aligned16(c)) &&
           (!d || cu_aligned16(d)) && (!e || cu_aligned16(e));
}

// out = x * sigmoid(g); thread t takes the elements [VEC*t, VEC*t + VEC) of each stride.
template <typename T, int VEC>
__global__ void sigmoid_gate_fwd_kernel(T *out, const T *x, const T *g, size_t items) {
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < items; t += step) {
        size_t i = t * VEC;
        float xv[VEC], gv[VEC], o[VEC];
        load_vec<T, VEC>(x + i, xv);
        load_vec<T, VEC>(g + i, gv);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            o[k] = xv[k] * sigmoidf_(gv[k]);
        store_vec<T, VEC>(out + i, o);
    }
}

template <typename T, int VEC>
__global__ void sigmoid_gate_bwd_kernel(T *dx, T *dg, const T *dout, const T *x, const T *g,
                                        size_t items) {
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < items; t += step) {
        size_t i = t * VEC;
        float dv[VEC], xv[VEC], gv[VEC], dxv[VEC], dgv[VEC];
        load_vec<T, VEC>(dout + i, dv);
        load_vec<T, VEC>(x + i, xv);
        load_vec<T, VEC>(g + i, gv);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float s = sigmoidf_(gv[k]);
            dxv[k] = dv[k] * s;
            dgv[k] = dv[k] * xv[k] * s * (1.0f - s);
        }
        store_vec<T, VEC>(dx + i, dxv);
        store_vec<T, VEC>(dg + i, dgv);
    }
}

template <typename T> void sigmoid_gate_fwd(void *out, const void *x, const void *g, size_t n) {
    if (n == 0) return;
    constexpr int V = kPack<T>;
    if (flat_vectorisable(n, V, out, x, g))
        sigmoid_gate_fwd_kernel<T, V><<<flat_blocks(n / V), kThreads, 0, cu_stream()>>>(
            (T *)out, (const T *)x, (const T *)g, n / V);
    else
        sigmoid_gate_fwd_kernel<T, 1>
            <<<flat_blocks(n), kThreads, 0, cu_stream()>>>((T *)out, (const T *)x, (const T *)g, n);
    CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void sigmoid_gate_bwd(void *dx, void *dg, const void *dout, const void *x, const void *g,
                      size_t n) {
    if (n == 0) return;
    constexpr int V = kPack<T>;
    if (flat_vectorisable(n, V, dx, dg, dout, x, g))
        sigmoid_gate_bwd_kernel<T, V><<<flat_blocks(n / V), kThreads, 0, cu_stream()>>>(
            (T *)dx, (T *)dg, (const T *)dout, (const T *)x, (const T *)g, n / V);
    else
        sigmoid_gate_bwd_kernel<T, 1><<<flat_blocks(n), kThreads, 0, cu_stream()>>>(
            (T *)dx, (T *)dg, (const T *)dout, (const T *)x, (const T *)g, n);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- dtype conversions

// dst: (n) T = src: (n) fp32, round to nearest even (fp16: overflow to +-inf).
template <typename T, int VEC> __global__ void cast_kernel(T *dst, const float *src, size_t items) {
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < items; t += step) {
        float v[VEC];
        load_vec<float, VEC>(src + t * VEC, v);
        store_vec<T, VEC>(dst + t * VEC, v);
    }
}

// The fp32 "cast" is a device-to-device copy on the compute stream.
template <typename T> void cast_from_f32(void *dst, const float *src, size_t n) {
    if (n == 0) return;
    if constexpr (std::is_same<T, float>::value) {
        CUDA_CHECK(
            cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, cu_stream()));
    } else {
        constexpr int V = kPack<T>; // 8: two float4 loads, one 16-byte store
        if (flat_vectorisable(n, V, dst, src))
            cast_kernel<T, V>
                <<<flat_blocks(n / V), kThreads, 0, cu_stream()>>>((T *)dst, src, n / V);
        else
            cast_kernel<T, 1><<<flat_blocks(n), kThreads, 0, cu_stream()>>>((T *)dst, src, n);
        CUDA_CHECK(cudaGetLastError());
    }
}

// The 16 bits of a T as fp32, exactly, on the host (the bits of a download).
template <typename T> float host_widen(uint16_t b);
template <> float host_widen<__nv_bfloat16>(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; // bf16 -> fp32 is exact
    float f;
    memcpy(&f, &u, 4);
    return f;
}
template <> float host_widen<__half>(uint16_t b) {
    return __half2float(__ushort_as_half(b)); // exact: every fp16 value is an fp32 normal
}

// host: (n) fp32 = src: (n) T on the device; waits (for the ops before it, in stream order,
// and for the copy itself). 16-bit T: the 2n bytes land in the upper half of the host buffer
// itself (no temporary), then widen in place front to back: writing float i (bytes [4i,
// 4i+4)) never reaches an unread element j > i (bytes from 2n + 2i + 2 on, and 4i + 4 <= 2n
// + 2i + 2 for i <= n - 1), and element i is read before float i is written. Byte copies
// through unsigned char keep it free of aliasing assumptions.
template <typename T> void download_f32(float *host, const void *src, size_t n) {
    if (n == 0) return;
    if constexpr (std::is_same<T, float>::value) {
        CUDA_CHECK(
            cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, cu_stream()));
        CUDA_CHECK(cudaStreamSynchronize(cu_stream()));
    } else {
        static_assert(sizeof(T) == 2, "the in-place widening assumes 2-byte elements");
        unsigned char *bytes = (unsigned char *)host;
        CUDA_CHECK(cudaMemcpyAsync(bytes + 2 * n, src, 2 * n, cudaMemcpyDeviceToHost, cu_stream()));
        CUDA_CHECK(cudaStreamSynchronize(cu_stream()));
        for (size_t i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, bytes + 2 * n + 2 * i, 2);
            float f = host_widen<T>(b);
            memcpy(bytes + 4 * i, &f, 4);
        }
    }
}

} // namespace

#define ELEMENTWISE_OPS(S, T)                                                                      \
    void cuda_swiglu_fwd_##S(void *out, const void *h, int N, int FF) {                            \
        swiglu_fwd<T>(out, h, N, FF);                                                              \
    }                                                                                              \
    void cuda_swiglu_bwd_##S(void *dh, const void *dout, const void *h, int N, int FF) {           \
        swiglu_bwd<T>(dh, dout, h, N, FF);                                                         \
    }                                                                                              \
    void cuda_sigmoid_gate_fwd_##S(void *out, const void *x, const void *g, size_t n) {            \
        sigmoid_gate_fwd<T>(out, x, g, n);                                                         \
    }                                                                                              \
    void cuda_sigmoid_gate_bwd_##S(void *dx, void *dg, const void *dout, const void *x,            \
                                   const void *g, size_t n) {                                      \
        sigmoid_gate_bwd<T>(dx, dg, dout, x, g, n);                                                \
    }                                                                                              \
    void cuda_cast_from_f32_##S(void *dst, const float *src, size_t n) {                           \
        cast_from_f32<T>(dst, src, n);                                                             \
    }                                                                                              \
    void cuda_download_f32_##S(float *host, const void *src, size_t n) {                           \
        download_f32<T>(host, src, n);                                                             \
    }

ELEMENTWISE_OPS(f32, float)
ELEMENTWISE_OPS(bf16, __nv_bfloat16)
ELEMENTWISE_OPS(f16, __half)
