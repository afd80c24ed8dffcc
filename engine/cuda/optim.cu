// optim.cu: the optimizer ops of the CUDA backend: the global gradient norm (sum of
// squares), gradient clipping (scale), AdamW and Muon (Newton-Schulz on cuBLASLt).
//
// Numerics: the formulas of engine/optim.c, operation by operation. The CPU build is ISO C
// (no FMA contraction), so the element-wise math here spells every multiply and add with
// the _rn intrinsics: nvcc would otherwise fuse them into FMAs and round differently. With
// IEEE sqrt and division (nvcc's defaults) AdamW and the Muon element-wise steps give the
// CPU's bits for the same inputs; the sums of squares add in another (fixed) order, and
// Newton-Schulz's GEMMs are cuBLASLt's (fp32, no TF32).
//
// Determinism: no atomics. A sum of squares is two passes: each block adds a fixed
// contiguous chunk in double (per thread in index order, then a fixed tree in shared
// memory) into cuda_scratch(), then one block adds the partials the same way. The
// partition depends only on n, so the bits do not depend on the GPU either.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/cuda/cuda_backend.h"

#define THREADS 256
#define ELEM_GRID_MAX 8192 // grid-stride loops past 2M elements: enough blocks for any GPU
#define SUM_BLOCKS_MAX 1024
#define SUM_PER_BLOCK_MIN 4096 // small tensors use fewer blocks
#define TILE 32                // Muon's transposing tiles: (TILE, TILE) per block
#define TILE_ROWS 8            // threads per block: (TILE, TILE_ROWS)

static cudaStream_t stream(void) {
    return (cudaStream_t)cuda_stream();
}

static unsigned elem_grid(size_t n) {
    size_t blocks = (n + THREADS - 1) / THREADS;
    if (blocks < 1) blocks = 1;
    return (unsigned)(blocks < ELEM_GRID_MAX ? blocks : ELEM_GRID_MAX);
}

// ---------------------------------------------------------------- sum of squares

// Fixed-order sum of the THREADS values in sh (blockDim.x == THREADS); result in sh[0].
__device__ static void block_sum(double *sh) {
    for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) sh[threadIdx.x] += sh[threadIdx.x + stride];
        __syncthreads();
    }
}

// partial: (gridDim.x). Block b sums x[i]^2 over its chunk [b*chunk, (b+1)*chunk) ∩ [0,n);
// thread t takes i = lo+t, lo+t+THREADS, ... in order (loads batched by 4, adds in order).
static __global__ void sum_squares_partial(double *partial, const float *x, size_t n,
                                           size_t chunk) {
    __shared__ double sh[THREADS];
    size_t lo = (size_t)blockIdx.x * chunk;
    size_t hi = lo + chunk < n ? lo + chunk : n;
    double s = 0.0;
    size_t i = lo + threadIdx.x;
    for (; i + 3 * THREADS < hi; i += 4 * THREADS) {
        double a = x[i], b = x[i + THREADS], c = x[i + 2 * THREADS], d = x[i + 3 * THREADS];
        s = __dadd_rn(s, __dmul_rn(a, a));
        s = __dadd_rn(s, __dmul_rn(b, b));
        s = __dadd_rn(s, __dmul_rn(c, c));
        s = __dadd_rn(s, __dmul_rn(d, d));
    }
    for (; i < hi; i += THREADS) {
        double a = x[i];
        s = __dadd_rn(s, __dmul_rn(a, a));
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    block_sum(sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// out[0] = the sum of partial: (n_partial), one block of THREADS.
static __global__ void sum_partials(double *out, const double *partial, int n_partial) {
    __shared__ double sh[THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < n_partial; i += THREADS)
        s = __dadd_rn(s, partial[i]);
    sh[threadIdx.x] = s;
    __syncthreads();
    block_sum(sh);
    if (threadIdx.x == 0) out[0] = sh[0];
}

extern "C" void cuda_sum_squares(double *out, const float *x, size_t n) {
    size_t blocks = (n + SUM_PER_BLOCK_MIN - 1) / SUM_PER_BLOCK_MIN;
    if (blocks < 1) blocks = 1;
    if (blocks > SUM_BLOCKS_MAX) blocks = SUM_BLOCKS_MAX;
    size_t chunk = (n + blocks - 1) / blocks;
    double *partial = (double *)cuda_scratch(blocks * sizeof(double));
    if (!partial) return; // recorded (engine/backend.h's failure rule)
    sum_squares_partial<<<(unsigned)blocks, THREADS, 0, stream()>>>(partial, x, n, chunk);
    CUDA_CHECK(cudaGetLastError());
    sum_partials<<<1, THREADS, 0, stream()>>>(out, partial, (int)blocks);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- scale

// x: (n) *= factor.
static __global__ void scale_kernel(float *x, size_t n, float factor) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], factor);
}

extern "C" void cuda_scale(float *x, size_t n, float factor) {
    if (!n) return;
    scale_kernel<<<elem_grid(n), THREADS, 0, stream()>>>(x, n, factor);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- AdamW

// One torch.optim.AdamW step on (n) floats; the CPU's adamw_update loop body, unfused.
static __global__ void adamw_kernel(float *w, const float *g, float *exp_avg, float *exp_avg_sq,
                                    size_t n, AdamwArgs a) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        float wi = __fmul_rn(w[i], a.decay);
        float m = __fadd_rn(__fmul_rn(exp_avg[i], a.beta1), __fmul_rn(gi, a.one_minus_beta1));
        float v = __fadd_rn(__fmul_rn(exp_avg_sq[i], a.beta2),
                            __fmul_rn(__fmul_rn(gi, gi), a.one_minus_beta2));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.bc2_sqrt), a.eps);
        w[i] = __fadd_rn(wi, __fmul_rn(-a.step_size, __fdiv_rn(m, denom)));
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

extern "C" void cuda_adamw(float *w, const float *g, float *exp_avg, float *exp_avg_sq, size_t n,
                           const AdamwArgs *a) {
    if (!n) return;
    adamw_kernel<<<elem_grid(n), THREADS, 0, stream()>>>(w, g, exp_avg, exp_avg_sq, n, *a);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- Muon

// torch.lerp's two-branch formula (engine/optim.c lerp), unfused.
__device__ static float lerp_rn(float start, float end, float weight) {
    return weight < 0.5f
               ? __fadd_rn(start, __fmul_rn(weight, __fsub_rn(end, start)))
               : __fsub_rn(end, __fmul_rn(__fsub_rn(end, start), __fsub_rn(1.0f, weight)));
}

// buf, g: (rows, cols). buf = lerp(buf, g, 1-momentum); x = lerp(g, buf, momentum) (Nesterov)
// or x = buf (nesterov 0),
// x: (rows, cols), or (cols, rows) when transposed. Block (TILE, TILE_ROWS) on a (TILE, TILE)
// tile; the transposed write goes through shared memory so both sides stay coalesced.
static __global__ void muon_momentum(float *x, float *buf, const float *g, int rows, int cols,
                                     float momentum, float one_minus_momentum, int nesterov,
                                     int transposed) {
    __shared__ float tile[TILE][TILE + 1]; // +1 column: no bank conflicts reading it across
    int j = blockIdx.x * TILE + threadIdx.x;
    for (int di = threadIdx.y; di < TILE; di += TILE_ROWS) {
        int i = blockIdx.y * TILE + di;
        if (i < rows && j < cols) {
            size_t k = (size_t)i * cols + j;
            float gk = g[k];
            float b = lerp_rn(buf[k], gk, one_minus_momentum);
            buf[k] = b;
            float u = nesterov ? lerp_rn(gk, b, momentum) : b;
            if (transposed)
                tile[di][threadIdx.x] = u; // element (i, j) of the tile
            else
                x[k] = u;
        }
    }
    if (!transposed) return; // uniform over the block, so the barrier below is safe
    __syncthreads();
    int i = blockIdx.y * TILE + threadIdx.x; // now threadIdx.x runs along rows
    for (int dj = threadIdx.y; dj < TILE; dj += TILE_ROWS) {
        int jj = blockIdx.x * TILE + dj;
        if (i < rows && jj < cols) x[(size_t)jj * rows + i] = tile[threadIdx.x][dj];
    }
}

// x: (n) /= max((float)sqrt(*sumsq), eps), the CPU's norm clamp.
static __global__ void muon_normalize(float *x, size_t n, const double *sumsq, float eps) {
    float norm = (float)sqrt(*sumsq);
    float divisor = norm > eps ? norm : eps;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fdiv_rn(x[i], divisor);
}

// w: (rows, cols) = w*decay - lr*ortho, ortho: (rows, cols), or (cols, rows) when transposed
// (read through a shared tile, coalesced).
static __global__ void muon_apply(float *w, const float *ortho, int rows, int cols, float decay,
                                  float lr, int transposed) {
    __shared__ float tile[TILE][TILE + 1];
    if (transposed) { // uniform over the block
        int i = blockIdx.y * TILE + threadIdx.x;
        for (int dj = threadIdx.y; dj < TILE; dj += TILE_ROWS) {
            int jj = blockIdx.x * TILE + dj;
            if (i < rows && jj < cols) tile[threadIdx.x][dj] = ortho[(size_t)jj * rows + i];
        }
        __syncthreads();
    }
    int j = blockIdx.x * TILE + threadIdx.x;
    for (int di = threadIdx.y; di < TILE; di += TILE_ROWS) {
        int i = blockIdx.y * TILE + di;
        if (i < rows && j < cols) {
            size_t k = (size_t)i * cols + j;
            float o = transposed ? tile[di][threadIdx.x] : ortho[k];
            w[k] = __fadd_rn(__fmul_rn(w[k], decay), __fmul_rn(-lr, o));
        }
    }
}

// Newton-Schulz on x: (r, c), r <= c, normalised in place; returns the buffer (x or next)
// holding the result. gram, poly: (r, r). The GEMMs are the CPU's cblas_sgemm calls.
static float *newton_schulz(float *x, float *next, float *gram, float *poly, int r, int c,
                            const MuonArgs *a) {
    size_t n = (size_t)r * c;
    for (int k = 0; k < a->ns_steps; k++) {
        // gram = x x^T: (r, r)
        cuda_sgemm_rm(0, 1, r, r, c, 1.0f, x, c, x, c, 0.0f, gram, r);
        // poly = ns_b*gram + ns_c*gram@gram
        CUDA_CHECK(cudaMemcpyAsync(poly, gram, (size_t)r * r * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream()));
        cuda_sgemm_rm(0, 0, r, r, r, a->ns_c, gram, r, gram, r, a->ns_b, poly, r);
        // next = ns_a*x + poly@x: (r, c)
        CUDA_CHECK(cudaMemcpyAsync(next, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream()));
        cuda_sgemm_rm(0, 0, r, c, r, 1.0f, poly, r, x, c, a->ns_a, next, c);
        float *t = x;
        x = next;
        next = t;
    }
    return x;
}

// scratch (muon_scratch_floats): x, next: (r, c); gram, poly: (r, r); then the norm's
// double, 8-byte aligned (2*r*c + 2*r*r floats is even, so it is when scratch is).
extern "C" void cuda_muon(float *w, const float *g, float *buf, float *scratch, const MuonArgs *a) {
    const int rows = a->rows, cols = a->cols;
    if (rows <= 0 || cols <= 0) return;
    const int transposed = rows > cols; // work on x: (r, c), r <= c, as the CPU does
    const int r = transposed ? cols : rows, c = transposed ? rows : cols;
    const size_t n = (size_t)rows * cols;
    float *x = scratch, *next = x + n, *gram = next + n, *poly = gram + (size_t)r * r;
    uintptr_t tail = (uintptr_t)(poly + (size_t)r * r);
    double *sumsq = (double *)((tail + 7) & ~(uintptr_t)7); // within the 4 spare floats

    const dim3 tiles((unsigned)((cols + TILE - 1) / TILE), (unsigned)((rows + TILE - 1) / TILE));
    if (tiles.y > 65535) {
        first_failure_record(&cuda_failures,
                             "cuda backend: Muon on a (%d, %d) matrix: more than %d rows", rows,
                             cols, 65535 * TILE);
        return;
    }
    const dim3 block(TILE, TILE_ROWS);
    muon_momentum<<<tiles, block, 0, stream()>>>(x, buf, g, rows, cols, a->momentum,
                                                 a->one_minus_momentum, a->nesterov, transposed);
    CUDA_CHECK(cudaGetLastError());
    cuda_sum_squares(sumsq, x, n);
    muon_normalize<<<elem_grid(n), THREADS, 0, stream()>>>(x, n, sumsq, a->norm_eps);
    CUDA_CHECK(cudaGetLastError());
    float *ortho = newton_schulz(x, next, gram, poly, r, c, a);
    muon_apply<<<tiles, block, 0, stream()>>>(w, ortho, rows, cols, a->decay, a->adjusted_lr,
                                              transposed);
    CUDA_CHECK(cudaGetLastError());
}
