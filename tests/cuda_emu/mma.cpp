// mma.cpp: the warp-level matrix instructions of emu.h (emu::ptx): ldmatrix and mma.sync,
// as warp-collective operations of the scheduler (emu.cpp): every lane deposits its
// operands, the last arrival's release computes all 32 results from them.
//
// The layouts follow NVIDIA's PTX ISA (8.x), section "Warp Level Matrix Multiply-Accumulate
// Instructions". A lane l has groupID g = l >> 2 and threadID_in_group t = l % 4; of each
// 32-bit register holding two b16 elements, the lower half is the element with the lower
// index (the lower column, or k).
#include "tests/cuda_emu/emu.h"

namespace emu {
namespace ptx {

namespace {

// Element `half` (0: the low 16 bits) of a register of two bf16 or two f16 values, exactly.
template <bool F16> float b16_value(uint32_t reg, int half) {
    const unsigned short bits = (unsigned short)(half ? reg >> 16 : reg & 0xffffu);
    return F16 ? __half2float(__ushort_as_half(bits))
               : __bfloat162float(__ushort_as_bfloat16(bits));
}

uint16_t b16_at(const unsigned char *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// Figure "ldmatrix fragment layout for one 8x8 matrix with 16-bit elements" (section
// "Warp-level matrix load instruction: ldmatrix"): with .x4, lanes 8j..8j+7 give the
// addresses of rows 0..7 of matrix j, and lane l receives in register j the elements
// (row l/4, columns 2(l%4), 2(l%4)+1) of matrix j; .trans delivers the matrix transposed,
// the elements (rows 2(l%4), 2(l%4)+1, column l/4).
template <bool Trans> void ldmatrix_compute(const void *const in[32], void *const out[32]) {
    for (int l = 0; l < 32; l++) {
        uint32_t *r = static_cast<uint32_t *>(out[l]);
        for (int j = 0; j < 4; j++) {
            uint16_t e[2];
            for (int h = 0; h < 2; h++) {
                int row = Trans ? 2 * (l % 4) + h : l / 4, col = Trans ? l / 4 : 2 * (l % 4) + h;
                uint32_t row_addr = *static_cast<const uint32_t *>(in[8 * j + row]);
                e[h] = b16_at(shared_at(row_addr + 2 * (uint32_t)col, 2, "ldmatrix"));
            }
            r[j] = (uint32_t)e[0] | (uint32_t)e[1] << 16;
        }
    }
}

struct MmaIn {
    std::array<uint32_t, 4> a;
    std::array<uint32_t, 2> b;
    std::array<float, 4> c;
};

// The figures of section "Matrix Fragments for mma.m16n8k16 with floating point type": the
// fragment layouts for matrix A with .f16/.bf16 type (Figure 79 in PTX ISA 8.7), for
// matrix B with .f16/.bf16 type and for the accumulators C/D with .f32 type, and the row
// and column formulas given with them (one layout for both 16-bit types: F16 only says how
// the 16 bits of an element read):
//   A (16x16): register r holds a_{2r}, a_{2r+1}: row g + 8 (r & 1), columns 2t + 8 (r >> 1)
//              and +1 (row groupID for a0, a1, a4, a5, else groupID+8; column
//              threadID_in_group*2 + (i & 1), +8 for i >= 4);
//   B (16x8):  register r holds b_{2r}, b_{2r+1}: rows (k) 2t + 8r and +1, column g;
//   C, D (16x8): c_i at row g + 8 (i >> 1), column 2t + (i & 1).
// The products of bf16 (8-bit significands) or f16 values (11 bits, subnormals included) are
// exact in double and the sum of 16 of them nearly so, then one rounding to fp32. The
// hardware's accumulation order and rounding are its own (PTX does not specify them): a test
// must allow fp32 roundings in every such sum.
template <bool F16> void mma_compute(const void *const in[32], void *const out[32]) {
    double A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        const MmaIn &x = *static_cast<const MmaIn *>(in[l]);
        const int g = l >> 2, t = l % 4;
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 2; h++)
                A[g + 8 * (r & 1)][2 * t + 8 * (r >> 1) + h] = b16_value<F16>(x.a[r], h);
        for (int r = 0; r < 2; r++)
            for (int h = 0; h < 2; h++)
                B[2 * t + 8 * r + h][g] = b16_value<F16>(x.b[r], h);
        for (int i = 0; i < 4; i++)
            C[g + 8 * (i >> 1)][2 * t + (i & 1)] = x.c[i];
    }
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l % 4;
        float *d = static_cast<float *>(out[l]);
        for (int i = 0; i < 4; i++) {
            const int m = g + 8 * (i >> 1), n = 2 * t + (i & 1);
            double acc = 0;
            for (int k = 0; k < 16; k++)
                acc += A[m][k] * B[k][n];
            d[i] = (float)(acc + C[m][n]);
        }
    }
}

} // namespace

void ldmatrix_x4(bool trans, std::array<uint32_t *, 4> d, uint32_t addr) {
    // Each lane's address: one row of 8 b16 elements, 16-byte aligned (PTX ISA, ldmatrix).
    if (addr % 16) fail("ldmatrix row address %u (shared) is not 16-byte aligned", addr);
    shared_at(addr, 16, "an ldmatrix row");
    uint32_t r[4];
    if (trans)
        warp_collective("ldmatrix.trans", ldmatrix_compute<true>, &addr, r);
    else
        warp_collective("ldmatrix", ldmatrix_compute<false>, &addr, r);
    for (int j = 0; j < 4; j++)
        *d[j] = r[j];
}

void mma_m16n8k16_f32(bool f16, std::array<float *, 4> d, std::array<uint32_t, 4> a,
                      std::array<uint32_t, 2> b, std::array<float, 4> c) {
    const MmaIn in = {a, b, c};
    float r[4];
    // Two computes: lanes of one warp at the .bf16 and the .f16 form are at different
    // operations, an error the scheduler reports.
    if (f16)
        warp_collective("mma.sync.m16n8k16.f16", mma_compute<true>, &in, r);
    else
        warp_collective("mma.sync.m16n8k16.bf16", mma_compute<false>, &in, r);
    for (int i = 0; i < 4; i++)
        *d[i] = r[i];
}

} // namespace ptx
} // namespace emu
