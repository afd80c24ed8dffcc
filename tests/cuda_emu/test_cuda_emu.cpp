// test_cuda_emu.cpp: the CUDA kernels of engine/cuda/ (embedding, rmsnorm, rope,
// elementwise, cross_entropy, optim, attention, moe), run on the CPU emulator (emu.h; the sources
// generated from the real .cu files by gen.py), against the CPU reference kernels
// (engine/cpu/), in fp32, bf16 and fp16, and attention (its tensor-core and SIMT kernels, and
// generation's attention_decode, which is checked against the CPU's too) against a float64
// attention written here. Checks per op:
// - the result matches the CPU's: bit for bit where the formulas promise it (copies, the
//   embedding sums, casts, AdamW, scale, MoE's routing and combination), else within a
//   tolerance (fp32 ~1e-5 relative; bf16 and fp16 outputs one bf16 / fp16 rounding of the fp32
//   result, the CPU given the same rounded inputs; attention: per element, from the roundings
//   its path makes, see attn_allowed); fp16 overflows to inf where the fp32 result is past
//   its range, never to a clamped finite value (the trainer's loss scaling looks for the inf);
// - run again with blocks and threads in reverse order, the bits are the same (no race or
//   order dependence);
// - nothing is written outside the buffers (guard bands around each);
// and the emulator's PTX (ldmatrix, mma.sync: the PTX ISA's fragment layouts element by
// element; cp.async: when copies land) and its refusals (a misaligned or out-of-bounds
// address, a warp-collective operation some lanes left, a copy in flight at exit: each in a
// child process that must abort).
// Buffers are 16-byte aligned (the kernels' vector paths) or one element off (the scalar
// paths). The fp16 checks run last, so the random inputs of the others are those they always
// had. Prints one line per check; exits 1 if any failed.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

extern "C" { // first: C linkage for engine/backend.h (muon_scratch_floats) too
#include "engine/cpu/cpu_kernels.h"
}
#include "engine/cuda/cuda_backend.h"
#include "tests/cuda_emu/emu.h"

#ifndef ASTRAI_CPU_NO_FMA // 1: the CPU reference was compiled without FMA contraction
#define ASTRAI_CPU_NO_FMA 0
#endif

typedef __nv_bfloat16 bf16;
typedef __half f16;
extern size_t emu_scratch_peak; // context_stub.cpp

// ---------------------------------------------------------------- dtypes

// The cuda_* ops of one compute dtype.
template <typename T> struct Ops;
#define OPS(S, T)                                                                                  \
    template <> struct Ops<T> {                                                                    \
        static constexpr const char *name = #S;                                                    \
        static constexpr auto embedding_fwd = cuda_embedding_fwd_##S;                              \
        static constexpr auto embedding_bwd = cuda_embedding_bwd_##S;                              \
        static constexpr auto rmsnorm_fwd = cuda_rmsnorm_fwd_##S;                                  \
        static constexpr auto rmsnorm_bwd = cuda_rmsnorm_bwd_##S;                                  \
        static constexpr auto rope_fwd = cuda_rope_fwd_##S;                                        \
        static constexpr auto rope_bwd = cuda_rope_bwd_##S;                                        \
        static constexpr auto swiglu_fwd = cuda_swiglu_fwd_##S;                                    \
        static constexpr auto swiglu_bwd = cuda_swiglu_bwd_##S;                                    \
        static constexpr auto sigmoid_gate_fwd = cuda_sigmoid_gate_fwd_##S;                        \
        static constexpr auto sigmoid_gate_bwd = cuda_sigmoid_gate_bwd_##S;                        \
        static constexpr auto cast_from_f32 = cuda_cast_from_f32_##S;                              \
        static constexpr auto download_f32 = cuda_download_f32_##S;                                \
        static constexpr auto cross_entropy_fwd = cuda_cross_entropy_fwd_##S;                      \
        static constexpr auto cross_entropy_bwd = cuda_cross_entropy_bwd_##S;                      \
        static constexpr auto gaussian_noise_add = cuda_gaussian_noise_add_##S;                    \
        static constexpr auto attention_fwd = cuda_attention_fwd_##S;                              \
        static constexpr auto attention_bwd = cuda_attention_bwd_##S;                              \
        static constexpr auto attention_decode = cuda_attention_decode_##S;                        \
        static constexpr auto copy_rows = cuda_copy_rows_##S;                                      \
        static constexpr auto moe_route = cuda_moe_route_##S;                                      \
        static constexpr auto moe_route_bwd = cuda_moe_route_bwd_##S;                              \
        static constexpr auto moe_combine = cuda_moe_combine_##S;                                  \
        static constexpr auto moe_combine_bwd = cuda_moe_combine_bwd_##S;                          \
    };
OPS(f32, float)
OPS(bf16, bf16)
OPS(f16, f16)

// fp16 (IEEE binary16) on the host from first principles, independent of emu.h's conversions
// (which the kernels use): the value of 16 bits, and the bits of the fp16 value nearest to f.
static double f16_value(uint16_t h) {
    const int e = h >> 10 & 0x1f, m = h & 0x3ff;
    const double v = e == 0x1f ? (m ? NAN : INFINITY) : e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return h & 0x8000 ? -v : v;
}
// Ties to even; the bits of one sign are in the order of their values, 0 to 0x7bff (65504),
// and past the largest finite value IEEE rounds as if the exponent went on: inf (0x7c00)
// stands for 2^16. A binary search for the neighbours of |f|, compared in double.
static uint16_t f16_bits_nearest(float f) {
    if (std::isnan(f)) return 0x7fff;
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double a = fabs((double)f);
    auto value = [](unsigned b) { return b == 0x7c00 ? 0x1p16 : f16_value((uint16_t)b); };
    if (a >= 0x1p16) return sign | 0x7c00;
    unsigned lo = 0, hi = 0x7c00; // value(lo) <= a < value(hi)
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        (value(mid) <= a ? lo : hi) = mid;
    }
    const double dl = a - value(lo), dh = value(hi) - a;
    return (uint16_t)(sign | (dl < dh ? lo : dh < dl ? hi : (lo & 1) ? hi : lo));
}

static float widen(float v) {
    return v;
}
static float widen(bf16 v) {
    return __bfloat162float(v);
}
static float widen(f16 v) {
    return (float)f16_value(__half_as_ushort(v));
}
template <typename T> T narrow(float v);
template <> float narrow<float>(float v) {
    return v;
}
template <> bf16 narrow<bf16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> f16 narrow<f16>(float v) {
    return __ushort_as_half(f16_bits_nearest(v));
}
// v as T holds it: the inputs both sides see.
template <typename T> std::vector<float> quant(std::vector<float> v) {
    for (float &x : v)
        x = widen(narrow<T>(x));
    return v;
}

// ---------------------------------------------------------------- device buffers

static int failures;
static std::string current_op;

// n elements of T standing for device memory: 16-byte aligned plus `skew` elements, between
// guard bands that must be intact when the buffer goes.
template <typename T> class Dev {
  public:
    explicit Dev(size_t n, int skew = 0)
        : raw_(n * sizeof(T) + 2 * kGuard + 64 + 16, kFill), n_(n) {
        uintptr_t at = ((uintptr_t)raw_.data() + kGuard + 15) & ~(uintptr_t)15;
        p_ = (T *)(at + (size_t)skew * sizeof(T));
    }
    Dev(const std::vector<float> &v, int skew = 0) : Dev(v.size(), skew) {
        for (size_t i = 0; i < n_; i++)
            p_[i] = narrow<T>(v[i]);
    }
    Dev(const Dev &) = delete;
    Dev &operator=(const Dev &) = delete;
    ~Dev() {
        const unsigned char *lo = (const unsigned char *)p_ - kGuard;
        const unsigned char *hi = (const unsigned char *)(p_ + n_);
        for (size_t k = 0; k < kGuard; k++)
            if (lo[k] != kFill || hi[k] != kFill) {
                printf("FAIL %s: wrote outside a buffer of %zu elements\n", current_op.c_str(), n_);
                failures++;
                return;
            }
    }
    T *get() {
        return p_;
    }
    operator T *() {
        return p_;
    }
    std::vector<float> floats() const {
        std::vector<float> v(n_);
        for (size_t i = 0; i < n_; i++)
            v[i] = widen(p_[i]);
        return v;
    }

  private:
    static constexpr size_t kGuard = 64;
    static constexpr unsigned char kFill = 0xa5;
    std::vector<unsigned char> raw_;
    T *p_;
    size_t n_;
};

// ---------------------------------------------------------------- checks

typedef std::vector<std::vector<float>> Outs;

// Runs the emulated op (which builds its buffers from the inputs and returns its outputs)
// with blocks and threads in forward, then reverse order; the two must agree bit for bit.
template <typename F> Outs run_both(const std::string &op, F f) {
    current_op = op;
    emu::set_reverse(false);
    Outs a = f();
    emu::set_reverse(true);
    Outs b = f();
    emu::set_reverse(false);
    bool same = a.size() == b.size();
    for (size_t k = 0; same && k < a.size(); k++)
        same = a[k].size() == b[k].size() &&
               !memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float));
    if (!same) {
        printf("FAIL %s: different bits with blocks and threads in reverse order\n", op.c_str());
        failures++;
    }
    return a;
}

struct Tol {
    double rtol, atol;  // |got - want| <= atol + rtol * |want|, atol
    double atol_of_max; // + atol_of_max * max |want| (for sums that cancel)
};
static const Tol kExact = {0, 0, 0};
// One bf16 rounding (half an ulp: 2^-8 of the value at most) of an fp32 result that may
// itself differ by a few fp32 ulps.
static const Tol kBf16 = {1.0 / 256 + 2e-5, 0, 1e-6};
// One fp16 rounding: 2^-11 of a normal value, and 2^-25 absolute below 2^-14, where fp16's
// subnormals are 2^-24 apart.
static const Tol kF16 = {1.0 / 2048 + 2e-5, 0x1p-25, 1e-6};

template <typename T> Tol out_tol(Tol f32) {
    if (sizeof(T) == 4) return f32;
    const Tol &r = std::is_same<T, bf16>::value ? kBf16 : kF16;
    return Tol{r.rtol + f32.rtol, r.atol + f32.atol, r.atol_of_max + f32.atol_of_max};
}

// |got[i] - want[i]| <= allowed[i] for every i (a NaN matches only a NaN).
static void check_within(const std::string &what, const std::vector<float> &got,
                         const std::vector<float> &want, const std::vector<double> &allowed) {
    bool ok = got.size() == want.size();
    double max_err = 0, worst = 0;
    size_t at = 0;
    for (size_t i = 0; ok && i < want.size(); i++) {
        double g = got[i], w = want[i], err = fabs(g - w);
        double r;
        if (g == w || (std::isnan(g) && std::isnan(w)))
            r = 0;
        else if (!std::isfinite(g) || !std::isfinite(w) || allowed[i] == 0)
            r = INFINITY;
        else
            r = err / allowed[i];
        if (r > worst) {
            worst = r;
            at = i;
        }
        if (std::isfinite(err)) max_err = std::max(max_err, err);
    }
    ok = ok && worst <= 1.0;
    if (!ok) failures++;
    if (got.size() != want.size())
        printf("%-4s %-50s size %zu, want %zu\n", "FAIL", what.c_str(), got.size(), want.size());
    else
        printf("%-4s %-50s n=%-7zu max|err| %-9.3g (%.2g of tol; at %zu: %.9g vs %.9g)\n",
               ok ? "ok" : "FAIL", what.c_str(), want.size(), max_err, worst, at,
               want.empty() ? 0.0 : got[at], want.empty() ? 0.0 : want[at]);
}

static void check(const std::string &what, const std::vector<float> &got,
                  const std::vector<float> &want, Tol tol) {
    double max_want = 0;
    for (float w : want)
        max_want = std::max(max_want, (double)fabsf(w));
    std::vector<double> allowed(want.size());
    for (size_t i = 0; i < want.size(); i++)
        allowed[i] = tol.atol + tol.rtol * fabs(want[i]) + tol.atol_of_max * max_want;
    check_within(what, got, want, allowed);
}

static std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char *f, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

static std::mt19937 rng(20240611);
static std::vector<float> randn(size_t n, float scale = 1.0f, float shift = 0.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float &x : v)
        x = d(rng) + shift;
    return v;
}
static std::vector<int32_t> randi(size_t n, int hi) {
    std::vector<int32_t> v(n);
    for (int32_t &x : v)
        x = (int32_t)(rng() % (unsigned)hi);
    return v;
}

// ---------------------------------------------------------------- embedding

template <typename T> void test_embedding(int N, int C, int V, int skew) {
    const char *dt = Ops<T>::name;
    std::vector<float> table = quant<T>(randn((size_t)V * C));
    std::vector<int32_t> ids = randi(N, V / 3 + 1); // many repeats
    std::vector<int32_t> by_id(N);
    std::iota(by_id.begin(), by_id.end(), 0);
    std::stable_sort(by_id.begin(), by_id.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::string tag = fmt("%s N%d C%d V%d%s", dt, N, C, V, skew ? " unaligned" : "");

    Outs fwd = run_both("embedding_fwd " + tag, [&] {
        Dev<T> out((size_t)N * C, skew), tab(table, skew);
        Dev<int32_t> id(N);
        std::copy(ids.begin(), ids.end(), id.get());
        Ops<T>::embedding_fwd(out, id, tab, N, C);
        return Outs{out.floats()};
    });
    std::vector<float> want((size_t)N * C);
    cpu_embedding_fwd(want.data(), ids.data(), table.data(), N, C);
    check("embedding_fwd " + tag + " (exact)", fwd[0], want, kExact);

    std::vector<float> dout = quant<T>(randn((size_t)N * C)), dtable0 = randn((size_t)V * C);
    Outs bwd = run_both("embedding_bwd " + tag, [&] {
        Dev<float> dtab(dtable0, skew);
        Dev<T> d(dout, skew);
        Dev<int32_t> id(N), by(N);
        std::copy(ids.begin(), ids.end(), id.get());
        std::copy(by_id.begin(), by_id.end(), by.get());
        Ops<T>::embedding_bwd(dtab, d, id, by, N, C);
        return Outs{dtab.floats()};
    });
    std::vector<float> dref = dtable0;
    cpu_embedding_bwd(dref.data(), dout.data(), ids.data(), by_id.data(), N, C);
    check("embedding_bwd " + tag + " (exact)", bwd[0], dref, kExact);
}

// ---------------------------------------------------------------- rmsnorm

// accs: which accumulate_dinp to test (bit 0: 0, bit 1: 1).
template <typename T>
void test_rmsnorm(int N, int G, int C, int stride, int skew, int accs = 3, float eps = 1e-6f) {
    const char *dt = Ops<T>::name;
    const size_t tot = (size_t)N * stride;
    std::vector<float> x = quant<T>(randn(tot, 2.0f)), w = quant<T>(randn(C, 0.5f, 1.0f));
    std::string tag = fmt("%s N%d G%d C%d stride%d%s%s", dt, N, G, C, stride,
                          eps != 1e-6f ? fmt(" eps%g", eps).c_str() : "", skew ? " unaligned" : "");

    // Out of place (the gaps between groups stay as they were: 0.5) and in place.
    std::vector<float> fill(tot, 0.5f), want = fill, rstd((size_t)N * G);
    cpu_rmsnorm_fwd(want.data(), rstd.data(), x.data(), w.data(), N, G, C, stride, eps);
    std::vector<float> want_inplace = x, rstd2((size_t)N * G);
    cpu_rmsnorm_fwd(want_inplace.data(), rstd2.data(), x.data(), w.data(), N, G, C, stride, eps);
    for (int inplace = 0; inplace < 2; inplace++) {
        std::string name = "rmsnorm_fwd " + tag + (inplace ? " in place" : "");
        Outs got = run_both(name, [&] {
            Dev<T> out(inplace ? x : fill, skew), inp(x, skew), wt(w, skew);
            Dev<float> rs((size_t)N * G);
            Ops<T>::rmsnorm_fwd(out, rs, inplace ? out.get() : inp.get(), wt, N, G, C, stride, eps);
            return Outs{out.floats(), rs.floats()};
        });
        check(name, got[0], inplace ? want_inplace : want, out_tol<T>({1e-5, 0, 1e-7}));
        check("  rstd", got[1], rstd, {2e-6, 0, 0});
    }

    std::vector<float> d = quant<T>(randn(tot)), dx0 = quant<T>(randn(tot)), dw0 = randn(C);
    for (int acc = 0; acc < 2; acc++) {
        if (!(accs >> acc & 1)) continue;
        std::string name = fmt("rmsnorm_bwd %s acc%d", tag.c_str(), acc);
        Outs got = run_both(name, [&] {
            Dev<T> dinp(dx0, skew), dout(d, skew), inp(x, skew), wt(w, skew);
            Dev<float> dw(dw0, skew), rs(rstd);
            Ops<T>::rmsnorm_bwd(dinp, dw, dout, inp, wt, rs, N, G, C, stride, acc);
            return Outs{dinp.floats(), dw.floats()};
        });
        std::vector<float> dxr = dx0, dwr = dw0;
        cpu_rmsnorm_bwd(dxr.data(), dwr.data(), d.data(), x.data(), w.data(), rstd.data(), N, G, C,
                        stride, acc);
        check(name + " dinp", got[0], dxr, out_tol<T>({1e-5, 0, 1e-5}));
        check("  dweight (fp32)", got[1], dwr, {1e-5, 0, 1e-5});
    }
}

// ---------------------------------------------------------------- rope

template <typename T> void test_rope(int N, int G, int D, int stride, int skew) {
    const int P = 50;
    std::vector<float> cs((size_t)P * D);
    for (int p = 0; p < P; p++)
        for (int i = 0; i < D / 2; i++) {
            double a = p * pow(10000.0, -2.0 * i / D);
            cs[(size_t)p * D + 2 * i] = (float)cos(a);
            cs[(size_t)p * D + 2 * i + 1] = (float)sin(a);
        }
    std::vector<int32_t> pos = randi(N, P);
    std::vector<float> x = quant<T>(randn((size_t)N * stride));
    for (int dir = 0; dir < 2; dir++) {
        std::string name = fmt("rope_%s %s N%d G%d D%d stride%d%s", dir ? "bwd" : "fwd",
                               Ops<T>::name, N, G, D, stride, skew ? " unaligned" : "");
        Outs got = run_both(name, [&] {
            Dev<T> v(x, skew);
            Dev<int32_t> ps(N);
            std::copy(pos.begin(), pos.end(), ps.get());
            Dev<float> c(cs, skew);
            (dir ? Ops<T>::rope_bwd : Ops<T>::rope_fwd)(v, ps, c, N, G, D, stride);
            return Outs{v.floats()};
        });
        std::vector<float> want = x;
        (dir ? cpu_rope_bwd : cpu_rope_fwd)(want.data(), pos.data(), cs.data(), N, G, D, stride);
        check(name, got[0], want, out_tol<T>({2e-6, 0, 1e-7}));
    }
}

// ---------------------------------------------------------------- elementwise

template <typename T> void test_swiglu(int N, int FF, int skew) {
    std::string tag = fmt("%s N%d FF%d%s", Ops<T>::name, N, FF, skew ? " unaligned" : "");
    std::vector<float> h = quant<T>(randn((size_t)N * 2 * FF, 2.0f));
    std::vector<float> d = quant<T>(randn((size_t)N * FF));
    Outs got = run_both("swiglu " + tag, [&] {
        Dev<T> hh(h, skew), out((size_t)N * FF, skew), dout(d, skew), dh((size_t)N * 2 * FF, skew);
        Ops<T>::swiglu_fwd(out, hh, N, FF);
        Ops<T>::swiglu_bwd(dh, dout, hh, N, FF);
        return Outs{out.floats(), dh.floats()};
    });
    std::vector<float> want((size_t)N * FF), dwant((size_t)N * 2 * FF);
    cpu_swiglu_fwd(want.data(), h.data(), N, FF);
    cpu_swiglu_bwd(dwant.data(), d.data(), h.data(), N, FF);
    check("swiglu_fwd " + tag, got[0], want, out_tol<T>({2e-6, 1e-30, 0}));
    check("swiglu_bwd " + tag, got[1], dwant, out_tol<T>({2e-6, 1e-30, 1e-7}));
}

template <typename T> void test_sigmoid_gate(size_t n, int skew) {
    std::string tag = fmt("%s n%zu%s", Ops<T>::name, n, skew ? " unaligned" : "");
    std::vector<float> x = quant<T>(randn(n)), g = quant<T>(randn(n, 3.0f)), d = quant<T>(randn(n));
    Outs got = run_both("sigmoid_gate " + tag, [&] {
        Dev<T> xx(x, skew), gg(g, skew), dd(d, skew), out(n, skew), dx(n, skew), dg(n, skew);
        Ops<T>::sigmoid_gate_fwd(out, xx, gg, n);
        Ops<T>::sigmoid_gate_bwd(dx, dg, dd, xx, gg, n);
        return Outs{out.floats(), dx.floats(), dg.floats()};
    });
    std::vector<float> want(n), dxw(n), dgw(n);
    cpu_sigmoid_gate_fwd(want.data(), x.data(), g.data(), n);
    cpu_sigmoid_gate_bwd(dxw.data(), dgw.data(), d.data(), x.data(), g.data(), n);
    Tol tol = out_tol<T>({2e-6, 1e-30, 1e-7});
    check("sigmoid_gate_fwd " + tag, got[0], want, tol);
    check("sigmoid_gate_bwd " + tag + " dx", got[1], dxw, tol);
    check("sigmoid_gate_bwd " + tag + " dg", got[2], dgw, tol);
}

// bf16 nearest to f (ties to even), from first principles: the two bf16 neighbours of f
// compared in double. Independent of emu.h's __float2bfloat16_rn.
static float bf16_nearest(float f) {
    if (std::isnan(f) || std::isinf(f)) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo_bits = u & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
    float lo, hi;
    memcpy(&lo, &lo_bits, 4); // f truncated towards zero
    memcpy(&hi, &hi_bits, 4); // the next bf16 away from zero (may be inf)
    // Past the largest bf16, IEEE rounds as if the exponent went on: inf stands for 2^128.
    double hv = std::isinf(hi) ? copysign(0x1p128, f) : hi;
    double dl = fabs((double)f - lo), dh = fabs(hv - f);
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo_bits >> 16 & 1) ? hi : lo;
}

// The T nearest to f, as a float (first principles: bf16_nearest, f16_bits_nearest).
template <typename T> float nearest(float f) {
    if constexpr (std::is_same<T, bf16>::value)
        return bf16_nearest(f);
    else if constexpr (std::is_same<T, f16>::value)
        return (float)f16_value(f16_bits_nearest(f));
    else
        return f;
}

template <typename T> void test_casts(size_t n, int skew) {
    std::string tag = fmt("%s n%zu%s", Ops<T>::name, n, skew ? " unaligned" : "");
    std::vector<float> x = randn(n, 10.0f);
    const float special[] = {1.00390625f,
                             1.01171875f,
                             -1.00390625f,
                             0.0f,
                             -0.0f,
                             3.4e38f,
                             -3.4e38f,
                             1e-40f,
                             INFINITY,
                             -INFINITY,
                             1.0f + 0x1p-8f + 0x1p-23f};
    // fp16's own edges: ties (to even, both ways), its largest value 65504, the overflow
    // threshold 65520 (the tie between 65504 and 2^16: inf) and just below it, overflow of
    // either sign, the subnormals (2^-24; 2^-25 the tie to 0, 3 * 2^-25 to 2^-23, the largest
    // subnormal plus a half step up to 2^-14), an fp32 denormal, infinities, NaN.
    const float special_f16[] = {1.0f + 0x1p-11f, 1.0f + 0x3p-11f, -(1.0f + 0x1p-11f),
                                 -0.0f,           65504.0f,        65520.0f - 0x1p-8f,
                                 65520.0f,        -65520.0f,       1e5f,
                                 -3.4e38f,        0x1p-24f,        0x1p-25f,
                                 0x3p-25f,        0x7ffp-25f,      1e-40f,
                                 INFINITY,        -INFINITY,       NAN};
    const bool is_f16 = std::is_same<T, f16>::value;
    const float *sp = is_f16 ? special_f16 : special;
    const size_t n_sp =
        is_f16 ? sizeof special_f16 / sizeof *special_f16 : sizeof special / sizeof *special;
    for (size_t i = 0; i < n_sp && i < n; i++)
        x[i] = sp[i]; // ties (to even, both ways), zeros, overflow, denormal, infinities
    Outs got = run_both("cast_from_f32 " + tag, [&] {
        Dev<float> src(x, skew);
        Dev<T> dst(n, skew);
        Ops<T>::cast_from_f32(dst, src, n);
        Dev<float> host(n, skew);
        Ops<T>::download_f32(host, dst, n);
        return Outs{dst.floats(), host.floats()};
    });
    std::vector<float> want = x;
    for (float &v : want)
        v = nearest<T>(v);
    check("cast_from_f32 " + tag + " (exact)", got[0], want, kExact);
    check("download_f32 " + tag + " (exact)", got[1], want, kExact);
}

// ---------------------------------------------------------------- cross-entropy

// scaled: per-row dloss factors (DPO/GRPO token weights, some negative) instead of none.
template <typename T> void test_cross_entropy(int N, int V, float ls, int skew, int scaled = 0) {
    std::string tag = fmt("%s N%d V%d ls%g%s%s", Ops<T>::name, N, V, ls, skew ? " unaligned" : "",
                          scaled ? " row-scaled" : "");
    std::vector<float> z = randn((size_t)N * V, 3.0f);
    for (int j = 0; j < V; j++) {
        if (N > 1) z[(size_t)1 * V + j] = -500.0f + 0.01f * j; // the max grows at every element
        if (N > 2) z[(size_t)2 * V + j] = 40.0f - 0.01f * j;   // the first is the max
    }
    z = quant<T>(z);
    std::vector<int32_t> t = randi(N, V), m(N);
    for (int n = 0; n < N; n++)
        m[n] = n % 4 != 3;
    t[0] = V - 1; // the last element of a row
    const float dloss = 0.37f;
    // Drawn only when used: the other cases keep the inputs they always had.
    std::vector<float> rs = scaled ? randn(N, 2.0f) : std::vector<float>(N, 1.0f);
    Outs got = run_both("cross_entropy " + tag, [&] {
        Dev<T> zz(z, skew), dz((size_t)N * V, skew);
        Dev<int32_t> tt(N), mm(N);
        std::copy(t.begin(), t.end(), tt.get());
        std::copy(m.begin(), m.end(), mm.get());
        Dev<float> loss(N), lse(N), scale(rs);
        Ops<T>::cross_entropy_fwd(loss, lse, zz, tt, mm, N, V, ls);
        Ops<T>::cross_entropy_bwd(dz, zz, lse, tt, mm, scaled ? (const float *)scale : nullptr, N,
                                  V, ls, dloss);
        return Outs{loss.floats(), lse.floats(), dz.floats()};
    });
    std::vector<float> loss(N), lse(N), dz((size_t)N * V);
    cpu_cross_entropy_fwd(loss.data(), lse.data(), z.data(), t.data(), m.data(), N, V, ls);
    cpu_cross_entropy_bwd(dz.data(), z.data(), lse.data(), t.data(), m.data(),
                          scaled ? rs.data() : nullptr, N, V, ls, dloss);
    check("cross_entropy_fwd " + tag + " loss", got[0], loss, {1e-5, 1e-5, 0});
    check("  lse", got[1], lse, {1e-6, 1e-6, 0});
    check("cross_entropy_bwd " + tag, got[2], dz, out_tol<T>({2e-5, 1e-9, 0}));
}

static void test_loss_mean(int N) {
    std::vector<float> loss = randn(N, 1.0f, 3.0f);
    int counted = N - N / 5;
    Outs got = run_both(fmt("loss_mean_add N%d", N), [&] {
        Dev<float> l(loss);
        Dev<double> acc(1);
        *acc.get() = 0.25;
        cuda_loss_mean_add(acc, l, N, counted);
        return Outs{{(float)(*acc.get() - 0.25)}};
    });
    double want = 0.25;
    cpu_loss_mean_add(&want, loss.data(), N, counted);
    // The double sums differ in order: at most one float rounding apart.
    check(fmt("loss_mean_add N%d", N), got[0], {(float)(want - 0.25)}, {1.2e-7, 0, 0});
}

// ---------------------------------------------------------------- preference losses

// Per-token NLLs: positive, 0 where the token does not count (as cross_entropy_fwd leaves them).
static std::vector<float> nlls(const std::vector<int32_t> &mask, float shift) {
    std::vector<float> x = randn(mask.size(), 0.5f, shift);
    for (size_t n = 0; n < x.size(); n++)
        x[n] = mask[n] ? fabsf(x[n]) : 0.0f;
    return x;
}

static void test_dpo_loss(int P, int T) {
    std::vector<int32_t> mask = randi((size_t)2 * P * T, 4);
    for (int32_t &m : mask)
        m = m != 0; // 3 in 4 count
    std::vector<float> nll = nlls(mask, 1.0f), ref = nlls(mask, 1.0f);
    const float beta = 0.3f, loss_scale = 0.5f;
    Outs got = run_both(fmt("dpo_loss P%d T%d", P, T), [&] {
        Dev<float> n(nll), r(ref), scale((size_t)2 * P * T);
        Dev<double> acc(4);
        std::fill(acc.get(), acc.get() + 4, 0.0);
        cuda_dpo_loss(acc, scale, n, r, P, T, beta, loss_scale);
        const double *a = acc.get();
        return Outs{{(float)a[0], (float)a[2], (float)a[3]}, scale.floats()};
    });
    double acc[4] = {0, 0, 0, 0};
    std::vector<float> scale((size_t)2 * P * T);
    cpu_dpo_loss(acc, scale.data(), nll.data(), ref.data(), P, T, beta, loss_scale);
    check(fmt("dpo_loss P%d T%d loss, margin, accuracy", P, T), got[0],
          {(float)acc[0], (float)acc[2], (float)acc[3]}, {1e-6, 1e-7, 0});
    check("  token scale", got[1], scale, {1e-6, 1e-9, 0});
}

// old == ref as in offline GRPO, and a policy far enough from them that some ratios clip.
static void test_grpo_loss(int R, int T) {
    std::vector<int32_t> mask = randi((size_t)R * T, 3);
    for (int32_t &m : mask)
        m = m != 0;
    int counted = 0;
    for (int32_t m : mask)
        counted += m;
    std::vector<float> nll = nlls(mask, 1.0f), ref = nlls(mask, 1.0f), adv = randn(R, 1.0f);
    adv[0] = 0.0f; // a group of equal rewards
    const float eps = 0.2f, kl = 0.05f, loss_scale = 0.25f;
    Outs got = run_both(fmt("grpo_loss R%d T%d", R, T), [&] {
        Dev<float> n(nll), r(ref), a(adv), scale((size_t)R * T);
        Dev<int32_t> m((size_t)R * T);
        std::copy(mask.begin(), mask.end(), m.get());
        Dev<double> acc(4);
        std::fill(acc.get(), acc.get() + 4, 0.0);
        cuda_grpo_loss(acc, scale, n, r, r, a, m, R, T, (float)counted, eps, kl, loss_scale);
        const double *x = acc.get();
        return Outs{{(float)x[0], (float)x[2], (float)x[3]}, scale.floats()};
    });
    double acc[4] = {0, 0, 0, 0};
    std::vector<float> scale((size_t)R * T);
    cpu_grpo_loss(acc, scale.data(), nll.data(), ref.data(), ref.data(), adv.data(), mask.data(), R,
                  T, counted, eps, kl, loss_scale);
    if (!(acc[3] > 0 && acc[3] < 1)) { // the case must exercise both clip branches
        printf("FAIL grpo_loss R%d T%d: clip fraction %g\n", R, T, acc[3]);
        failures++;
    }
    check(fmt("grpo_loss R%d T%d loss, kl, clip fraction", R, T), got[0],
          {(float)acc[0], (float)acc[2], (float)acc[3]}, {1e-6, 1e-7, 0});
    check("  token scale", got[1], scale, {1e-6, 1e-9, 0});
}

// NEFTune's draws: the emulated kernel equals the CPU op element for element, and the CPU's
// draws are standard normal (mean, variance, a tail) and differ between seeds.
template <typename T> void test_noise(size_t n) {
    std::string tag = fmt("%s n%zu", Ops<T>::name, n);
    std::vector<float> x = quant<T>(randn(n, 1.0f));
    const float std_ = 0.25f;
    const uint64_t seed = 12345;
    Outs got = run_both("gaussian_noise_add " + tag, [&] {
        Dev<T> xx(x);
        Ops<T>::gaussian_noise_add(xx, n, std_, seed);
        return Outs{xx.floats()};
    });
    std::vector<float> want = x;
    cpu_gaussian_noise_add(want.data(), n, std_, seed);
    for (float &v : want)
        v = nearest<T>(v);
    check("gaussian_noise_add " + tag, got[0], want, out_tol<T>({1e-6, 1e-6, 0}));
    std::vector<float> z(n, 0.0f), z2(n, 0.0f);
    cpu_gaussian_noise_add(z.data(), n, 1.0f, seed);
    cpu_gaussian_noise_add(z2.data(), n, 1.0f, seed + 1);
    double mean = 0, var = 0, same = 0, tail = 0;
    for (size_t i = 0; i < n; i++) {
        mean += z[i];
        var += (double)z[i] * z[i];
        same += z[i] == z2[i];
        tail += fabs(z[i]) > 1.96;
    }
    mean /= n;
    var = var / n - mean * mean;
    double se = 1.0 / sqrt((double)n); // one standard error of the mean
    bool ok = fabs(mean) < 5 * se && fabs(var - 1) < 5 * sqrt(2.0) * se &&
              fabs(tail / n - 0.05) < 5 * sqrt(0.05 * 0.95 / n) && same < 0.001 * n;
    printf("%s noise statistics %s: mean %.4f var %.4f P(|z|>1.96) %.4f, equal to seed+1's %g\n",
           ok ? "ok  " : "FAIL", tag.c_str(), mean, var, tail / n, same);
    failures += !ok;
}

// ---------------------------------------------------------------- optimizer

static void test_sum_squares_scale(size_t n) {
    std::vector<float> x = randn(n, 2.0f);
    Outs got = run_both(fmt("sum_squares n%zu", n), [&] {
        Dev<float> xx(x);
        Dev<double> out(1);
        cuda_sum_squares(out, xx, n);
        double s = *out.get();
        std::vector<float> bits(2);
        memcpy(bits.data(), &s, 8);
        cuda_scale(xx, n, 0.3f);
        std::vector<float> r = xx.floats();
        r.insert(r.end(), bits.begin(), bits.end());
        return Outs{r};
    });
    double want;
    cpu_sum_squares(&want, x.data(), n);
    double s;
    memcpy(&s, got[0].data() + n, 8);
    bool ok = fabs(s - want) <= 1e-13 * want;
    printf("%-4s %-50s n=%-7zu rel err %.3g (%.17g vs %.17g)\n", ok ? "ok" : "FAIL",
           fmt("sum_squares n%zu", n).c_str(), n, fabs(s - want) / want, s, want);
    failures += !ok;
    std::vector<float> scaled = x;
    cpu_scale(scaled.data(), n, 0.3f);
    got[0].resize(n);
    check(fmt("scale n%zu (exact)", n), got[0], scaled, kExact);
}

static void test_adamw(size_t n) {
    std::vector<float> w = randn(n), g = randn(n, 0.1f), m = randn(n, 0.01f), v = randn(n, 1e-3f);
    for (float &x : v)
        x = x * x;
    const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.999;
    const int step = 3;
    AdamwArgs a;
    a.decay = (float)(1.0 - lr * wd);
    a.step_size = (float)(lr / (1.0 - pow(b1, step)));
    a.bc2_sqrt = (float)sqrt(1.0 - pow(b2, step));
    a.beta1 = (float)b1;
    a.beta2 = (float)b2;
    a.one_minus_beta1 = (float)(1.0 - b1);
    a.one_minus_beta2 = (float)(1.0 - b2);
    a.eps = 1e-8f;
    Outs got = run_both(fmt("adamw n%zu", n), [&] {
        Dev<float> ww(w), gg(g), mm(m), vv(v);
        cuda_adamw(ww, gg, mm, vv, n, &a);
        return Outs{ww.floats(), mm.floats(), vv.floats()};
    });
    std::vector<float> wr = w, mr = m, vr = v;
    cpu_adamw(wr.data(), g.data(), mr.data(), vr.data(), n, &a);
    // optim.cu spells every operation with _rn intrinsics, promising the CPU's bits (the CPU
    // is ISO C, compiled without FMA contraction; a C compiler that contracts gets 1 ulp).
    Tol tol = ASTRAI_CPU_NO_FMA ? kExact : Tol{3e-7, 0, 0};
    check(fmt("adamw n%zu w%s", n, ASTRAI_CPU_NO_FMA ? " (exact)" : ""), got[0], wr, tol);
    check("  exp_avg", got[1], mr, tol);
    check("  exp_avg_sq", got[2], vr, tol);
}

// engine/backend_open.c's muon_scratch_floats, restated: linking backend_open.o into a CUDA
// build would pull in the real CUDA context (context.cu), clashing with context_stub.cpp.
static size_t scratch_floats(int rows, int cols) {
    size_t r = (size_t)(rows < cols ? rows : cols);
    size_t n = 2 * (size_t)rows * (size_t)cols + 2 * r * r + 4;
#ifndef ASTRAI_HAVE_CUDA
    if (n != muon_scratch_floats(rows, cols)) {
        printf("FAIL muon: scratch_floats no longer restates muon_scratch_floats\n");
        failures++;
    }
#endif
    return n;
}

static void test_muon(int rows, int cols) {
    const size_t n = (size_t)rows * cols, scratch_n = scratch_floats(rows, cols);
    std::vector<float> w = randn(n), g = randn(n, 0.1f), buf = randn(n, 0.05f);
    MuonArgs a;
    a.rows = rows;
    a.cols = cols;
    a.ns_steps = 5;
    a.momentum = 0.95f;
    a.one_minus_momentum = (float)(1.0 - 0.95);
    a.decay = 1.0f; // w' - w is then -adjusted_lr * ortho: compared directly
    a.adjusted_lr = 0.5f;
    a.ns_a = 3.4445f;
    a.ns_b = -4.7750f;
    a.ns_c = 2.0315f;
    a.norm_eps = 1e-7f;
    std::string tag = fmt("muon %dx%d", rows, cols);
    Outs got = run_both(tag, [&] {
        Dev<float> ww(w), gg(g), bb(buf), scratch(scratch_n);
        cuda_muon(ww, gg, bb, scratch, &a);
        std::vector<float> upd = ww.floats();
        for (size_t i = 0; i < n; i++)
            upd[i] -= w[i];
        return Outs{upd, bb.floats()};
    });
    std::vector<float> wr = w, br = buf, scratch(scratch_n);
    cpu_muon(wr.data(), g.data(), br.data(), scratch.data(), &a);
    for (size_t i = 0; i < n; i++)
        wr[i] -= w[i];
    // The norms add in different orders; Newton-Schulz then carries the last-bit differences.
    check(tag + " update", got[0], wr, {1e-4, 0, 1e-5});
    check("  momentum buffer (exact)", got[1], br, kExact);
}

// ---------------------------------------------------------------- PTX instructions

// One block of one warp with `shmem` bytes of dynamic shared memory: lane l runs f(l).
static void warp_kernel(const std::function<void(int)> *f) {
    (*f)((int)threadIdx.x);
}
static void run_warp(size_t shmem, const std::function<void(int)> &f) {
    warp_kernel | emu::config(__FILE__, __LINE__, 1, 32, shmem, (cudaStream_t)cuda_stream()) |
        emu::args(&f);
}

static uint32_t shared_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// The element (row, col) of 8x8 b16 matrix m, a distinct value each.
static uint16_t ldm_value(int m, int row, int col) {
    return (uint16_t)(m * 64 + row * 8 + col);
}

// ldmatrix .x4 and .x4.trans against the PTX ISA's ldmatrix figure, element by element: the
// 32 rows (8 per matrix, lanes 8m..8m+7 giving matrix m's) scattered over shared memory.
static void test_ldmatrix() {
    std::vector<uint32_t> plain(32 * 4), trans(32 * 4);
    run_warp(32 * 16, [&](int l) {
        unsigned char *sm = (unsigned char *)emu::dynamic_shared();
        unsigned char *row = sm + (size_t)(l * 13 % 32) * 16; // lane l: row l%8 of matrix l/8
        for (int c = 0; c < 8; c++) {
            uint16_t v = ldm_value(l / 8, l % 8, c);
            memcpy(row + 2 * c, &v, 2);
        }
        __syncwarp();
        uint32_t *p = &plain[(size_t)l * 4], *t = &trans[(size_t)l * 4];
        emu::ptx::ldmatrix_x4(false, {p, p + 1, p + 2, p + 3}, shared_addr(row));
        emu::ptx::ldmatrix_x4(true, {t, t + 1, t + 2, t + 3}, shared_addr(row));
    });
    int bad = 0;
    for (int l = 0; l < 32; l++)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                uint16_t got = (uint16_t)(plain[(size_t)l * 4 + j] >> (16 * h));
                uint16_t got_t = (uint16_t)(trans[(size_t)l * 4 + j] >> (16 * h));
                bad += got != ldm_value(j, l / 4, 2 * (l % 4) + h);
                bad += got_t != ldm_value(j, 2 * (l % 4) + h, l / 4);
            }
    printf("%-4s ldmatrix.x4 and .x4.trans: the PTX ISA's fragment layout (%d wrong)\n",
           bad ? "FAIL" : "ok", bad);
    failures += bad != 0;
}

// Two values as one register of bf16 (f16 false) or fp16 elements, lo in the low half.
static uint32_t b16_pair(bool f16, float lo, float hi) {
    auto bits = [f16](float v) {
        return (uint32_t)(f16 ? f16_bits_nearest(v) : __float2bfloat16_rn(v).__x);
    };
    return bits(lo) | bits(hi) << 16;
}

// An element of an f16 operand of test_mma: a small integer over 1, 2 or 4, or (A only) 1
// in 16 a subnormal: the fp16 decoding of fractions and of the subnormals, with every sum of
// products (multiples of 2^-26 below 2^11) exact in double.
static float mma_f16_value(bool subnormals) {
    const int v = (int)(rng() % 17) - 8;
    if (subnormals && rng() % 16 == 0) return (float)v * 0x1p-24f;
    return (float)v / (float)(1 << rng() % 3);
}

// mma.sync m16n8k16 against the PTX ISA's fragment formulas for a0..a7, b0..b3 and c0..c3
// (.bf16 or .f16 A and B, .f32 C and D), element by element: bf16 on small integers (exact
// sums), f16 on mma_f16_value's (exact in double, as the emulator sums, then one rounding).
static void test_mma(bool f16) {
    float A[16][16], B[16][8], C[16][8], D[16][8];
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < 16; k++)
            A[m][k] = f16 ? mma_f16_value(true) : (float)((int)(rng() % 17) - 8);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++)
            B[k][n] = f16 ? mma_f16_value(false) : (float)((int)(rng() % 17) - 8);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++)
            C[m][n] = (float)((int)(rng() % 201) - 100);
    run_warp(0, [&](int l) {
        int group = l >> 2, tig = l % 4;
        float a[8], b[4], c[4];
        for (int i = 0; i < 8; i++) // row groupID for 0 <= i < 2 || 4 <= i < 6, else +8
            a[i] = A[(i < 2 || (i >= 4 && i < 6)) ? group : group + 8]
                    [tig * 2 + (i & 1) + (i >= 4 ? 8 : 0)];
        for (int i = 0; i < 4; i++)
            b[i] = B[tig * 2 + (i & 1) + (i >= 2 ? 8 : 0)][group];
        for (int i = 0; i < 4; i++)
            c[i] = C[i < 2 ? group : group + 8][tig * 2 + (i & 1)];
        float d[4];
        emu::ptx::mma_m16n8k16_f32(f16, {&d[0], &d[1], &d[2], &d[3]},
                                   {b16_pair(f16, a[0], a[1]), b16_pair(f16, a[2], a[3]),
                                    b16_pair(f16, a[4], a[5]), b16_pair(f16, a[6], a[7])},
                                   {b16_pair(f16, b[0], b[1]), b16_pair(f16, b[2], b[3])},
                                   {c[0], c[1], c[2], c[3]});
        for (int i = 0; i < 4; i++)
            D[i < 2 ? group : group + 8][tig * 2 + (i & 1)] = d[i];
    });
    int bad = 0;
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            double want = C[m][n];
            for (int k = 0; k < 16; k++)
                want += (double)A[m][k] * B[k][n];
            bad += D[m][n] != (float)want;
        }
    printf("%-4s mma.sync.m16n8k16 %s: the PTX ISA's fragment layout (%d wrong)\n",
           bad ? "FAIL" : "ok", f16 ? "f16" : "bf16", bad);
    failures += bad != 0;
}

// cp.async: a copy lands at the wait_group that completes its group (before, the destination
// reads as poison: NaN), wait_group 1 leaves the newest group in flight, a src-size of 0
// zero-fills, and dynamic shared memory starts as NaN.
static void test_cp_async() {
    alignas(16) static const float src[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    float seen[24];
    run_warp(64, [&](int l) {
        float *sm = (float *)emu::dynamic_shared();
        if (l != 0) return;
        memcpy(seen, sm, 16); // never written
        emu::ptx::cp_async(true, shared_addr(sm), (uint64_t)(uintptr_t)src, 16, 16);
        emu::ptx::cp_async_commit_group();
        emu::ptx::cp_async(false, shared_addr(sm + 4), (uint64_t)(uintptr_t)src, 4, 0);
        emu::ptx::cp_async(true, shared_addr(sm + 8), (uint64_t)(uintptr_t)(src + 4), 16, 16);
        emu::ptx::cp_async_commit_group();
        memcpy(seen + 4, sm, 16); // in flight
        emu::ptx::cp_async_wait_group(1);
        memcpy(seen + 8, sm, 16);      // the first group landed
        memcpy(seen + 12, sm + 8, 16); // the second not yet
        emu::ptx::cp_async_wait_group(0);
        memcpy(seen + 16, sm + 4, 32);
    });
    const float N = NAN,
                want[24] = {N, N, N, N, N, N, N, N, 1, 2, 3, 4, N, N, N, N, 0, N, N, N, 5, 6, 7, 8};
    int bad = 0;
    for (int k = 0; k < 24; k++)
        bad += !(seen[k] == want[k] || (std::isnan(seen[k]) && std::isnan(want[k])));
    printf("%-4s cp.async: lands at its wait_group, zero-fills; shared memory starts as NaN "
           "(%d wrong)\n",
           bad ? "FAIL" : "ok", bad);
    failures += bad != 0;
}

// What f writes to stderr, run in a child process (its wait status in *status).
static std::string child_stderr(const std::function<void()> &f, int *status) {
    int fds[2];
    if (pipe(fds) != 0) abort();
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        f();
        _exit(0);
    }
    close(fds[1]);
    std::string msg;
    char buf[512];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;)
        msg.append(buf, (size_t)n);
    close(fds[0]);
    waitpid(pid, status, 0);
    return msg;
}

// The emulator aborts, naming the launch, on what the hardware leaves undefined: f runs in a
// child process, which must die of SIGABRT with `needle` in its message.
static void expect_abort(const char *what, const char *needle, const std::function<void()> &f) {
    int status = 0;
    std::string msg = child_stderr(f, &status);
    bool ok = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT &&
              msg.find(needle) != std::string::npos && msg.find(__FILE__) != std::string::npos;
    printf("%-4s the emulator refuses %s%s%s\n", ok ? "ok" : "FAIL", what, ok ? "" : ": ",
           ok ? "" : msg.c_str());
    failures += !ok;
}

static void test_ptx_errors() {
    alignas(16) static const float src[8] = {};
    expect_abort("a misaligned ldmatrix row", "not 16-byte aligned", [] {
        run_warp(512, [](int l) {
            uint32_t r[4];
            unsigned char *sm = (unsigned char *)emu::dynamic_shared();
            emu::ptx::ldmatrix_x4(false, {r, r + 1, r + 2, r + 3}, shared_addr(sm + 16 * l + 8));
        });
    });
    expect_abort("an ldmatrix some lanes left", "never reach", [] {
        run_warp(512, [](int l) {
            uint32_t r[4];
            if (l == 31) return;
            unsigned char *sm = (unsigned char *)emu::dynamic_shared();
            emu::ptx::ldmatrix_x4(false, {r, r + 1, r + 2, r + 3}, shared_addr(sm + 16 * l));
        });
    });
    expect_abort("an mma.sync with lanes at an ldmatrix", "different warp-wide operations", [] {
        run_warp(512, [](int l) {
            uint32_t r[4] = {};
            float d[4] = {};
            unsigned char *sm = (unsigned char *)emu::dynamic_shared();
            if (l)
                emu::ptx::ldmatrix_x4(false, {r, r + 1, r + 2, r + 3}, shared_addr(sm + 16 * l));
            else
                emu::ptx::mma_m16n8k16_f32(false, {d, d + 1, d + 2, d + 3}, {}, {}, {});
        });
    });
    expect_abort("an mma.sync with lanes at .bf16 and at .f16", "different warp-wide operations",
                 [] {
                     run_warp(0, [](int l) {
                         float d[4] = {};
                         emu::ptx::mma_m16n8k16_f32(l == 7, {d, d + 1, d + 2, d + 3}, {}, {}, {});
                     });
                 });
    expect_abort("a cp.async past the dynamic shared memory", "outside the dynamic shared", [] {
        run_warp(64, [](int) {
            float *sm = (float *)emu::dynamic_shared();
            emu::ptx::cp_async(true, shared_addr(sm + 16), (uint64_t)(uintptr_t)src, 16, 16);
        });
    });
    expect_abort("a misaligned cp.async source", "16-byte aligned", [] {
        run_warp(64, [](int) {
            float *sm = (float *)emu::dynamic_shared();
            emu::ptx::cp_async(true, shared_addr(sm), (uint64_t)(uintptr_t)(src + 1), 16, 16);
        });
    });
    expect_abort("a thread ending with a cp.async in flight", "in flight", [] {
        run_warp(64, [](int) {
            float *sm = (float *)emu::dynamic_shared();
            emu::ptx::cp_async(false, shared_addr(sm), (uint64_t)(uintptr_t)src, 4, 4);
            emu::ptx::cp_async_commit_group();
        });
    });
}

// ---------------------------------------------------------------- attention

// q, k, v as the model holds them: one fused row [q heads | k heads | v heads] per token.
struct AttnProblem {
    int B, T, H, KVH, D;
    std::vector<float> qkv, dout; // (B*T, stride), (B,T,H,D)
    std::vector<int32_t> doc_start;
    int stride() const {
        return (H + 2 * KVH) * D;
    }
    const float *row(int b, int t, int head) const { // head: H + kvh for k, H + KVH + kvh v
        return &qkv[((size_t)b * T + t) * stride() + (size_t)head * D];
    }
};

// Key j is visible to query i of batch row b iff doc_start[b*T+i] <= j <= i. Packed: batch
// rows alternate between documents starting at 0, 37, 100 (query tiles that skip key
// tiles, key tiles that skip query tiles) and at 0, 5, 6 (short documents, then one long
// enough for a query tile to walk 3 key tiles); else causal only. A sliding window (> 0)
// hides keys j <= i - window too, as the model's batch folds it in: every row of a tile then
// starts at a different key.
static std::vector<int32_t> doc_starts(int B, int T, bool packed, int window) {
    static const std::vector<int> starts[2] = {{0, 37, 100}, {0, 5, 6}};
    std::vector<int32_t> ds((size_t)B * T, 0);
    for (int b = 0; packed && b < B; b++)
        for (int t = 0; t < T; t++)
            for (int s : starts[b % 2])
                if (s <= t) ds[(size_t)b * T + t] = s;
    for (int b = 0; window && b < B; b++)
        for (int t = 0; t < T; t++)
            ds[(size_t)b * T + t] = std::max(ds[(size_t)b * T + t], t - window + 1);
    return ds;
}

// Columns [c0, c1) of rows of `stride`.
template <typename V>
static std::vector<V> columns(const std::vector<V> &x, int stride, int c0, int c1) {
    std::vector<V> c;
    for (size_t r = 0; r < x.size() / stride; r++)
        c.insert(c.end(), x.begin() + r * stride + c0, x.begin() + r * stride + c1);
    return c;
}

// An output of the float64 reference, a sum of terms, and per element what its error may
// be made of: `val` the exact value; `rounded` the sum of |terms| (on the tensor-core path
// each term has a factor rounded to bf16 or fp16: P for out and dv, dS for dq and dk);
// `fp32` a magnitude that bounds what fp32 arithmetic may change; `other` the sum of |the
// other factor| of each term (v, dout, k or q: what a P or dS rounded to an fp16 subnormal,
// off by an absolute 2^-25 at most, may move the element by; see attn_allowed).
struct Expect {
    std::vector<double> val, rounded, fp32, other;
    explicit Expect(size_t n = 0) : val(n), rounded(n), fp32(n), other(n) {}
    void add(size_t at, double term, double fp32_term, double other_factor) {
        val[at] += term;
        rounded[at] += fabs(term);
        fp32[at] += fp32_term;
        other[at] += fabs(other_factor);
    }
    Expect columns(int stride, int c0, int c1) const {
        Expect e;
        e.val = ::columns(val, stride, c0, c1);
        e.rounded = ::columns(rounded, stride, c0, c1);
        e.fp32 = ::columns(fp32, stride, c0, c1);
        e.other = ::columns(other, stride, c0, c1);
        return e;
    }
    std::vector<float> floats() const {
        return std::vector<float>(val.begin(), val.end());
    }
};

static double dot_abs(const float *a, const float *b, int D, double *abs_sum) {
    double s = 0, m = 0;
    for (int d = 0; d < D; d++) {
        s += (double)a[d] * b[d];
        m += fabs((double)a[d] * b[d]);
    }
    *abs_sum = m;
    return s;
}

// out: (B,T,H,D), lse: (B,H,T). The fp32 magnitude of out: the scores' fp32 errors (D-term
// dot products: at most their sum of |terms| smag, times D ulps) move the probabilities
// relative to each other by up to twice the row's largest, and the normalised sum adds one.
static void ref_attention_fwd(const AttnProblem &p, Expect &out, Expect &lse) {
    const int T = p.T, H = p.H, D = p.D;
    const double scale = 1.0 / sqrt((double)D);
    out = Expect((size_t)p.B * T * H * D);
    lse = Expect((size_t)p.B * H * T);
    std::vector<double> s(T), smag(T);
    for (int b = 0; b < p.B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const int kvh = h / (H / p.KVH), j0 = p.doc_start[(size_t)b * T + i];
                double m = -INFINITY, l = 0, smax = 0;
                for (int j = j0; j <= i; j++) {
                    s[j] = scale * dot_abs(p.row(b, i, h), p.row(b, j, H + kvh), D, &smag[j]);
                    smag[j] *= scale;
                    m = std::max(m, s[j]);
                    smax = std::max(smax, smag[j]);
                }
                for (int j = j0; j <= i; j++)
                    l += exp(s[j] - m);
                const size_t at = ((size_t)b * H + h) * T + i;
                lse.add(at, m + log(l), 1 + fabs(m + log(l)) + smax, 0);
                for (int j = j0; j <= i; j++) {
                    const double pj = exp(s[j] - m) / l;
                    const float *v = p.row(b, j, H + p.KVH + kvh);
                    for (int d = 0; d < D; d++)
                        out.add(((size_t)(b * T + i) * H + h) * D + d, pj * v[d],
                                (2 + 2 * smax) * fabs(pj * v[d]), v[d]);
                }
            }
}

// dqkv: the qkv layout, from out and lse as the backward gets them (their values exactly),
// so that p = exp(s - lse) and delta = dout . out are the kernels' own definitions. fp32
// magnitudes: p's relative error is that of s - lse (smag + |lse|, plus its own rounding),
// dS's adds the absolute error of dP - delta (the dot products' sums of |terms|).
static void ref_attention_bwd(const AttnProblem &p, const std::vector<float> &out,
                              const std::vector<float> &lse, Expect &dqkv) {
    const int T = p.T, H = p.H, D = p.D, S = p.stride();
    const double scale = 1.0 / sqrt((double)D);
    dqkv = Expect((size_t)p.B * T * S);
    for (int b = 0; b < p.B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const int kvh = h / (H / p.KVH);
                const float *q = p.row(b, i, h), *o = &out[((size_t)(b * T + i) * H + h) * D];
                const float *dout = &p.dout[((size_t)(b * T + i) * H + h) * D];
                const double row_lse = lse[((size_t)b * H + h) * T + i];
                double delta_mag, delta = dot_abs(dout, o, D, &delta_mag);
                for (int j = p.doc_start[(size_t)b * T + i]; j <= i; j++) {
                    const float *k = p.row(b, j, H + kvh), *v = p.row(b, j, H + p.KVH + kvh);
                    double smag, dp_mag, s = scale * dot_abs(q, k, D, &smag);
                    const double pij = exp(s - row_lse), dp = dot_abs(dout, v, D, &dp_mag);
                    const double p_err = 2 + scale * smag + fabs(row_lse);
                    const double ds = pij * (dp - delta) * scale;
                    const double ds_mag = fabs(ds) * p_err + pij * scale * (dp_mag + delta_mag);
                    for (int d = 0; d < D; d++) {
                        const size_t ri = (size_t)(b * T + i) * S, rj = (size_t)(b * T + j) * S;
                        dqkv.add(ri + h * D + d, ds * k[d], ds_mag * fabs(k[d]), k[d]);
                        dqkv.add(rj + (H + kvh) * D + d, ds * q[d], ds_mag * fabs(q[d]), q[d]);
                        dqkv.add(rj + (H + p.KVH + kvh) * D + d, pij * dout[d],
                                 p_err * fabs(pij * dout[d]), dout[d]);
                    }
                }
            }
}

// What an element may differ by: u |val| where the output is stored as bf16 or fp16 (one
// rounding, u = 2^-8 the unit roundoff of bf16's 8-bit significand, 2^-11 of fp16's 11-bit
// one); u `rounded` on the tensor-core path, whose products take P and dS rounded to the
// storage type (each term off by at most u of itself: the sum by u times the sum of |terms|);
// and 2^-14 `fp32`: fp32's unit roundoff 2^-24 times the at most 1024 roundings a sum here
// can take (D + T terms, heads of a group), with room. Worst-case bounds, first order in u
// (u^2 is within the fp32 term). fp16 adds the absolute error of its subnormals (below
// 2^-14: off by up to 2^-25): once for the stored element, and per term whose P or dS is one.
struct Rounding {
    double out, mid;         // u or 0: the storage rounds; P and dS are rounded
    double out_abs, mid_abs; // 2^-25 or 0: the same roundings' subnormal floor (fp16)
};
static std::vector<double> attn_allowed(const Expect &e, Rounding r) {
    std::vector<double> a(e.val.size());
    for (size_t i = 0; i < a.size(); i++)
        a[i] = r.out * fabs(e.val[i]) + r.mid * e.rounded[i] + 0x1p-14 * e.fp32[i] + r.out_abs +
               r.mid_abs * e.other[i];
    return a;
}

// The attention ops of dtype T against the reference: forward, then the backward from the
// reference's out and lse as T and fp32 hold them. `mma`: the tensor-core kernels must run
// (bf16 or fp16, D 64 or 128, 16-byte aligned), else the SIMT ones; skew 1 misaligns every
// tensor.
template <typename T>
void test_attention(int B, int seq, int H, int KVH, int D, bool packed, bool mma, int skew = 0,
                    int window = 0) {
    AttnProblem p = {B, seq, H, KVH, D, {}, {}, doc_starts(B, seq, packed, window)};
    const int S = p.stride();
    p.qkv = quant<T>(randn((size_t)B * seq * S, 1.5f));
    p.dout = quant<T>(randn((size_t)B * seq * H * D));
    std::string tag = fmt("%s B%d T%d H%d KVH%d D%d %s%s%s", Ops<T>::name, B, seq, H, KVH, D,
                          packed ? "docs" : "causal", skew ? " unaligned" : "",
                          window ? fmt(" window %d", window).c_str() : "");
    const char *path = mma ? "tensor-core" : "simt";
    const bool is_f16 = std::is_same<T, f16>::value;
    const double u = is_f16 ? 0x1p-11 : 0x1p-8, sub = is_f16 ? 0x1p-25 : 0.0;
    const Rounding r = {sizeof(T) == 2 ? u : 0.0, mma ? u : 0.0, sub, mma ? sub : 0.0};
    auto dispatch = [&](const std::string &op) {
        if (strcmp(cuda_attention_kernels(), path)) {
            printf("FAIL %s %s: ran the %s kernels, not the %s ones\n", op.c_str(), tag.c_str(),
                   cuda_attention_kernels(), path);
            failures++;
        }
    };

    Expect out, lse;
    ref_attention_fwd(p, out, lse);
    Outs fwd = run_both("attention_fwd " + tag, [&] {
        Dev<T> qkv(p.qkv, skew), o((size_t)B * seq * H * D, skew);
        Dev<float> l((size_t)B * H * seq);
        Dev<int32_t> ds(p.doc_start.size());
        std::copy(p.doc_start.begin(), p.doc_start.end(), ds.get());
        Ops<T>::attention_fwd(o, l, qkv, qkv.get() + H * D, qkv.get() + (H + KVH) * D, ds, B, seq,
                              H, KVH, D, S);
        return Outs{o.floats(), l.floats()};
    });
    dispatch("attention_fwd");
    check_within(fmt("attention_fwd %s (%s) out", tag.c_str(), path), fwd[0], out.floats(),
                 attn_allowed(out, r));
    check_within("  lse", fwd[1], lse.floats(), attn_allowed(lse, {0, 0, 0, 0}));

    const std::vector<float> out_in = quant<T>(out.floats()), lse_in = lse.floats();
    Expect dqkv;
    ref_attention_bwd(p, out_in, lse_in, dqkv);
    Outs bwd = run_both("attention_bwd " + tag, [&] {
        Dev<T> qkv(p.qkv, skew), o(out_in, skew), d(p.dout, skew);
        Dev<T> g(std::vector<float>(p.qkv.size(), NAN), skew); // every element overwritten
        Dev<float> l(lse_in);
        Dev<int32_t> ds(p.doc_start.size());
        std::copy(p.doc_start.begin(), p.doc_start.end(), ds.get());
        Ops<T>::attention_bwd(g, g.get() + H * D, g.get() + (H + KVH) * D, d, o, l, qkv,
                              qkv.get() + H * D, qkv.get() + (H + KVH) * D, ds, B, seq, H, KVH, D,
                              S);
        return Outs{g.floats()};
    });
    dispatch("attention_bwd");
    const char *names[3] = {"dq", "dk", "dv"};
    const int c[4] = {0, H * D, (H + KVH) * D, S};
    for (int x = 0; x < 3; x++) {
        Expect e = dqkv.columns(S, c[x], c[x + 1]);
        check_within(x ? fmt("  %s", names[x]) : fmt("attention_bwd %s (%s) dq", tag.c_str(), path),
                     columns(bwd[0], S, c[x], c[x + 1]), e.floats(), attn_allowed(e, r));
    }
}

// A bf16 (fp16) call the tensor cores cannot take says why on stderr, once per reason: a
// silent fallback to the SIMT kernels would pass every comparison at a fraction of the speed.
// Two calls at head_dim 32, then two with misaligned tensors: two lines. In a child process,
// which inherits what this one said already: run before this process's own calls of E.
template <typename E> void test_fallback_said() {
    int status = 0;
    std::string msg = child_stderr(
        [] {
            for (int skew : {0, 0, 1, 1}) {
                const int B = 1, T = 5, H = 2, KVH = 1, D = skew ? 64 : 32, S = (H + 2 * KVH) * D;
                Dev<E> qkv(std::vector<float>((size_t)T * S, 0.5f), skew);
                Dev<E> o((size_t)T * H * D, skew);
                Dev<float> l((size_t)H * T);
                Dev<int32_t> ds(T);
                std::fill(ds.get(), ds.get() + T, 0);
                Ops<E>::attention_fwd(o, l, qkv, qkv.get() + H * D, qkv.get() + (H + KVH) * D, ds,
                                      B, T, H, KVH, D, S);
            }
        },
        &status);
    size_t lines = 0;
    for (size_t at = 0; (at = msg.find("runs the SIMT kernels", at)) != std::string::npos; at++)
        lines++;
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && lines == 2 &&
              msg.find("head_dim not 64 or 128: head_dim 32") != std::string::npos &&
              msg.find("a tensor not 16-byte aligned: head_dim 64") != std::string::npos;
    printf("%-4s %s attention on the SIMT kernels says why, once per reason%s%s\n",
           ok ? "ok" : "FAIL", std::is_same<E, f16>::value ? "an fp16" : "a bf16", ok ? "" : ": ",
           ok ? "" : msg.c_str());
    failures += !ok;
}

static void test_attention_all() {
    // Tensor cores: D 64 and 128, GQA and not, both masks, T past a tile edge (tiles of 64
    // queries or keys, 32 queries in dk/dv), a whole number of tiles, and T = 1; T = 130
    // gives query tiles of 3 key tiles, so the double-buffered copies reach their steady
    // state (a copy in flight while the previous tile's is waited for).
    test_attention<bf16>(2, 130, 4, 2, 64, true, true);
    test_attention<bf16>(1, 130, 4, 1, 128, false, true);
    test_attention<bf16>(2, 70, 2, 1, 128, true, true);
    test_attention<bf16>(2, 64, 2, 2, 64, false, true);
    test_attention<bf16>(1, 1, 2, 1, 64, false, true);
    test_attention<bf16>(1, 1, 2, 2, 128, true, true);
    // SIMT: fp32, bf16 where the tensor cores do not apply (head_dim, alignment).
    test_attention<float>(2, 70, 4, 2, 64, true, false);
    test_attention<float>(1, 130, 2, 1, 128, false, false);
    test_attention<float>(1, 1, 2, 1, 32, false, false);
    test_attention<bf16>(2, 70, 4, 2, 64, true, false, 1);
    test_attention<bf16>(1, 33, 2, 1, 32, false, false);
    // Sliding windows: shorter than a tile (query tiles of one or two key tiles, key tiles
    // visited by few query tiles), with documents, and longer than a tile.
    test_attention<bf16>(2, 130, 4, 2, 64, true, true, 0, 20);
    test_attention<bf16>(1, 200, 2, 1, 128, false, true, 0, 70);
    test_attention<float>(2, 130, 4, 2, 64, true, false, 0, 9);
    test_attention<float>(1, 130, 2, 1, 32, false, false, 0, 40);
}

// fp16 on both paths: the tensor cores at D 64 (GQA, documents, T = 130: the steady state of
// the double-buffered copies) and D 128 (causal, T past a tile edge; T = 1), SIMT where they
// do not apply (a misaligned tensor, head_dim 32).
static void test_attention_f16() {
    test_attention<f16>(2, 130, 4, 2, 64, true, true);
    test_attention<f16>(1, 70, 2, 1, 128, false, true);
    test_attention<f16>(1, 1, 2, 2, 128, true, true);
    test_attention<f16>(2, 70, 4, 2, 64, true, false, 1);
    test_attention<f16>(1, 33, 2, 1, 32, false, false);
    test_attention<f16>(2, 130, 4, 2, 64, true, true, 0, 20);
}

// Generation's step (attention_decode): one query per sequence and head over its KV cache
// (B, max_len, KVH, D), sequence b seeing keys [first, ends[b]) with first = ends[b] - window
// (at least 0; window 0: causal), every other cached key random (it must be ignored). q rows
// are strided as the model's fused qkv rows. Against the float64 attention (the SIMT path's
// roundings: the stored output's only) and against the CPU's attention_decode given the same
// rounded inputs (fp32 on both sides, then the output's rounding).
template <typename T>
void test_attention_decode(int H, int KVH, int D, int max_len, const std::vector<int> &ends,
                           int window, int skew = 0) {
    const int B = (int)ends.size(), S = (H + 2 * KVH) * D, group = H / KVH;
    const size_t nc = (size_t)B * max_len * KVH * D, no = (size_t)B * H * D;
    const std::vector<float> q = quant<T>(randn((size_t)B * S, 1.5f)),
                             k = quant<T>(randn(nc, 1.5f)), v = quant<T>(randn(nc));
    std::vector<int32_t> span(2 * (size_t)B);
    std::string lens;
    for (int b = 0; b < B; b++) {
        span[B + b] = ends[b];
        span[b] = window ? std::max(0, ends[b] - window) : 0;
        lens += fmt("%s%d", b ? "," : "", ends[b]);
    }
    std::string tag = fmt(
        "%s H%d KVH%d D%d max_len%d lens %s %s%s", Ops<T>::name, H, KVH, D, max_len, lens.c_str(),
        window ? fmt("window %d", window).c_str() : "causal", skew ? " unaligned" : "");
    const bool is_f16 = std::is_same<T, f16>::value;
    const Rounding r = {sizeof(T) == 2 ? (is_f16 ? 0x1p-11 : 0x1p-8) : 0.0, 0.0,
                        is_f16 ? 0x1p-25 : 0.0, 0.0};

    // The float64 reference, with ref_attention_fwd's error magnitudes.
    const double scale = 1.0 / sqrt((double)D);
    Expect out(no);
    std::vector<double> s(max_len), smag(max_len);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int kvh = h / group;
            const float *qr = &q[(size_t)b * S + (size_t)h * D];
            auto cached = [&](const std::vector<float> &c, int j) {
                return &c[(((size_t)b * max_len + j) * KVH + kvh) * D];
            };
            double m = -INFINITY, l = 0, smax = 0;
            for (int j = span[b]; j < span[B + b]; j++) {
                s[j] = scale * dot_abs(qr, cached(k, j), D, &smag[j]);
                smag[j] *= scale;
                m = std::max(m, s[j]);
                smax = std::max(smax, smag[j]);
            }
            for (int j = span[b]; j < span[B + b]; j++)
                l += exp(s[j] - m);
            for (int j = span[b]; j < span[B + b]; j++) {
                const double pj = exp(s[j] - m) / l;
                const float *vr = cached(v, j);
                for (int d = 0; d < D; d++)
                    out.add(((size_t)b * H + h) * D + d, pj * vr[d],
                            (2 + 2 * smax) * fabs(pj * vr[d]), vr[d]);
            }
        }

    Outs got = run_both("attention_decode " + tag, [&] {
        Dev<T> dq(q, skew), dk(k, skew), dv(v, skew);
        Dev<T> o(std::vector<float>(no, NAN), skew); // every element overwritten
        Dev<int32_t> sp(span.size());
        std::copy(span.begin(), span.end(), sp.get());
        Ops<T>::attention_decode(o, dq, dk, dv, sp, B, H, KVH, D, S, max_len);
        return Outs{o.floats()};
    });
    if (strcmp(cuda_attention_kernels(), "simt")) {
        printf("FAIL attention_decode %s: ran the %s kernels, not the simt ones\n", tag.c_str(),
               cuda_attention_kernels());
        failures++;
    }
    check_within(fmt("attention_decode %s", tag.c_str()), got[0], out.floats(),
                 attn_allowed(out, r));

    Err err = {};
    if (cpu_attention_reserve(max_len, D, &err)) {
        printf("FAIL attention_decode %s: cpu_attention_reserve: %s\n", tag.c_str(), err.msg);
        failures++;
        return;
    }
    std::vector<float> cpu(no);
    cpu_attention_decode(cpu.data(), q.data(), k.data(), v.data(), span.data(), B, H, KVH, D, S,
                         max_len);
    check("  vs the CPU's attention_decode", got[0], cpu, out_tol<T>(Tol{1e-5, 0, 1e-5}));
}

// Tiles of 32 keys and chunks of 8 query heads (attn_decode_simt): lengths 1, within, at and
// past a tile (several tiles), spans not starting at a tile edge (windows), GQA groups 1 to 8
// and 12 (two chunks, the second short), head dims 64 and 128 and odd ones, B > 1 with
// different lengths, unaligned tensors. Run last: the random inputs before are unchanged.
static void test_attention_decode_all() {
    for (int g = 1; g <= 8; g++) // every group size, two sequences of different lengths
        test_attention_decode<float>(2 * g, 2, 64, 72, {37, 70}, 0);
    test_attention_decode<float>(8, 1, 128, 130, {130, 64, 1}, 0);
    test_attention_decode<float>(12, 1, 37, 100, {45, 100}, 20);
    test_attention_decode<float>(6, 2, 24, 97, {5, 40, 97}, 33);
    test_attention_decode<float>(5, 5, 96, 8, {1, 2, 8}, 1); // each query sees its own key only
    test_attention_decode<float>(4, 2, 256, 40, {33, 40}, 0);
    test_attention_decode<float>(4, 1, 13, 50, {32, 33}, 100); // a window past the sequence
    test_attention_decode<bf16>(4, 2, 64, 80, {70, 1, 33}, 0);
    test_attention_decode<bf16>(8, 1, 128, 130, {130, 64}, 50);
    test_attention_decode<bf16>(14, 2, 37, 60, {60, 17}, 0);
    test_attention_decode<bf16>(6, 3, 64, 45, {40, 9}, 7, 1);
    test_attention_decode<f16>(4, 2, 64, 80, {70, 1, 33}, 0);
    test_attention_decode<f16>(16, 2, 128, 100, {100, 31}, 40);
    test_attention_decode<f16>(3, 1, 24, 35, {35, 12}, 0, 1);
}

// ---------------------------------------------------------------- mixture of experts

template <typename T> DType dtype_of() {
    return std::is_same<T, bf16>::value ? DT_BF16 : std::is_same<T, f16>::value ? DT_F16 : DT_F32;
}

template <typename V> static std::vector<float> as_floats(const V &v) {
    return std::vector<float>(v.begin(), v.end()); // int32 indices < 2^24: exact
}

// copy_rows: dst rows between untouched gaps (strides wider than the rows), any alignment.
template <typename T>
void test_copy_rows(int rows, int cols, int dst_stride, int src_stride, int skew) {
    std::string tag = fmt("%s rows%d cols%d dst_stride%d src_stride%d%s", Ops<T>::name, rows, cols,
                          dst_stride, src_stride, skew ? " unaligned" : "");
    std::vector<float> src = quant<T>(randn((size_t)rows * src_stride));
    std::vector<float> dst0 = quant<T>(randn((size_t)rows * dst_stride));
    Outs got = run_both("copy_rows " + tag, [&] {
        Dev<T> d(dst0, skew), s(src, skew);
        Ops<T>::copy_rows(d, dst_stride, s, src_stride, rows, cols);
        return Outs{d.floats()};
    });
    std::vector<float> want = dst0;
    cpu_copy_rows(want.data(), dst_stride, src.data(), src_stride, rows, cols);
    check("copy_rows " + tag + " (exact)", got[0], want, kExact);
}

// The CPU's routing of the same (rounded) logits.
struct Routing {
    std::vector<float> probs, weight;
    std::vector<int32_t> expert, counts, token_of, slot;
};
template <typename T> Routing route_ref(const std::vector<float> &z, int N, int E, int k) {
    Routing r{std::vector<float>((size_t)N * E),   std::vector<float>((size_t)N * k),
              std::vector<int32_t>((size_t)N * k), std::vector<int32_t>(E),
              std::vector<int32_t>((size_t)N * k), std::vector<int32_t>((size_t)N * k)};
    cpu_moe_route_dtype(dtype_of<T>(), r.probs.data(), r.weight.data(), r.expert.data(),
                        r.counts.data(), r.token_of.data(), r.slot.data(), z.data(), N, E, k);
    return r;
}

// Logits of N tokens over E experts for a routing case.
enum RouteCase { kRandom, kOneExpert, kEmptyExpert, kTies };
static const char *const kRouteCaseName[] = {"", " one expert", " an empty expert", " all tied"};
static std::vector<float> route_logits(RouteCase c, int N, int E) {
    std::vector<float> z = randn((size_t)N * E, 2.0f);
    for (int n = 0; n < N; n++)
        for (int e = 0; e < E; e++) {
            float &v = z[(size_t)n * E + e];
            if (c == kOneExpert && e == E / 2) v += 40.0f; // every token's first choice
            if (c == kEmptyExpert && e == E - 1) v -= 40.0f;
            if (c == kTies) v = 0.25f;
        }
    return z;
}

// moe_route against the CPU: every output bit for bit (the emulated expf is the host's, the
// sums the CPU's order; on a GPU expf may differ by an ulp), then moe_route_bwd of those
// probabilities (the CPU's order and roundings: exact when the CPU did not contract FMAs).
template <typename T> void test_moe_route(int N, int E, int k, RouteCase c) {
    std::string tag = fmt("%s N%d E%d k%d%s", Ops<T>::name, N, E, k, kRouteCaseName[c]);
    std::vector<float> z = quant<T>(route_logits(c, N, E));
    Outs got = run_both("moe_route " + tag, [&] {
        Dev<T> zz(z);
        Dev<float> probs((size_t)N * E), weight((size_t)N * k);
        Dev<int32_t> expert((size_t)N * k), counts(E), token_of((size_t)N * k), slot((size_t)N * k);
        Ops<T>::moe_route(probs, weight, expert, counts, token_of, slot, zz, N, E, k);
        return Outs{probs.floats(),  weight.floats(),   expert.floats(),
                    counts.floats(), token_of.floats(), slot.floats()};
    });
    Routing r = route_ref<T>(z, N, E, k);
    check("moe_route " + tag + " probs (exact)", got[0], r.probs, kExact);
    check("  weight (exact)", got[1], r.weight, kExact);
    check("  expert (exact)", got[2], as_floats(r.expert), kExact);
    check("  counts (exact)", got[3], as_floats(r.counts), kExact);
    check("  token_of (exact)", got[4], as_floats(r.token_of), kExact);
    check("  slot (exact)", got[5], as_floats(r.slot), kExact);
    // The case holds: one expert takes every token first (so with k = 1 all of them), or the
    // last one none.
    int want_count = c == kOneExpert ? N : c == kEmptyExpert ? 0 : -1;
    int at = c == kOneExpert ? E / 2 : E - 1;
    if (want_count >= 0 && (r.counts[at] != want_count || got[3][at] != (float)want_count)) {
        printf("FAIL moe_route %s: expert %d has %g pairs, want %d\n", tag.c_str(), at, got[3][at],
               want_count);
        failures++;
    }

    std::vector<float> dw = randn((size_t)N * k);
    Outs bwd = run_both("moe_route_bwd " + tag, [&] {
        Dev<T> dz((size_t)N * E);
        Dev<float> d(dw), probs(r.probs);
        Dev<int32_t> expert((size_t)N * k);
        std::copy(r.expert.begin(), r.expert.end(), expert.get());
        Ops<T>::moe_route_bwd(dz, d, probs, expert, N, E, k);
        return Outs{dz.floats()};
    });
    std::vector<float> dz((size_t)N * E);
    cpu_moe_route_bwd(dz.data(), dw.data(), r.probs.data(), r.expert.data(), N, E, k);
    for (float &v : dz)
        v = nearest<T>(v);
    check(fmt("moe_route_bwd %s%s", tag.c_str(), ASTRAI_CPU_NO_FMA ? " (exact)" : ""), bwd[0], dz,
          ASTRAI_CPU_NO_FMA ? kExact : out_tol<T>({1e-5, 1e-30, 1e-6}));
}

// The flags of a moe_combine case.
enum { kResid = 1, kShared = 2, kWeight = 4, kInPlace = 8, kAll = 7 };

// moe_combine and moe_combine_bwd over a routing of N tokens (the CPU's), rows (N*k, C) of
// expert outputs. fwd: the CPU's order and roundings (exact when the CPU did not contract);
// bwd: drows and dshared exact (one product each), dweight within fp32 summation error of
// the dot products (a block tree, not the CPU's order).
template <typename T> void test_moe_combine(int N, int E, int k, int C, int flags, int skew) {
    std::string tag =
        fmt("%s N%d k%d C%d%s%s%s%s%s", Ops<T>::name, N, k, C, flags & kResid ? " resid" : "",
            flags & kShared ? " shared" : "", flags & kWeight ? " weighted" : "",
            flags & kInPlace ? " in place" : "", skew ? " unaligned" : "");
    Routing r = route_ref<T>(quant<T>(route_logits(kRandom, N, E)), N, E, k);
    const size_t nc = (size_t)N * C, rc = (size_t)N * k * C;
    std::vector<float> rows = quant<T>(randn(rc)), resid = quant<T>(randn(nc)),
                       shared = quant<T>(randn(nc)), out0 = quant<T>(randn(nc));
    const float scale = 0.5f;
    const bool has_r = flags & kResid, has_s = flags & kShared, has_w = flags & kWeight;
    Outs got = run_both("moe_combine " + tag, [&] {
        Dev<T> out(out0, skew), rs(resid, skew), sh(shared, skew), y(rows, skew);
        Dev<float> w(r.weight);
        Dev<int32_t> slot(r.slot.size());
        std::copy(r.slot.begin(), r.slot.end(), slot.get());
        T *o = flags & kInPlace ? rs.get() : out.get();
        Ops<T>::moe_combine(o, has_r ? rs.get() : nullptr, has_s ? sh.get() : nullptr, scale, y,
                            has_w ? w.get() : nullptr, slot, N, k, C);
        return Outs{flags & kInPlace ? rs.floats() : out.floats()};
    });
    std::vector<float> want(nc);
    cpu_moe_combine(want.data(), has_r ? resid.data() : nullptr, has_s ? shared.data() : nullptr,
                    scale, rows.data(), has_w ? r.weight.data() : nullptr, r.slot.data(), N, k, C);
    for (float &v : want)
        v = nearest<T>(v);
    check(fmt("moe_combine %s%s", tag.c_str(), ASTRAI_CPU_NO_FMA ? " (exact)" : ""), got[0], want,
          ASTRAI_CPU_NO_FMA ? kExact : out_tol<T>({2e-6, 1e-30, 1e-7}));
    if (!has_w) return; // the gather-sum has no backward of its own

    std::vector<float> dout = quant<T>(randn(nc)), drows0 = quant<T>(randn(rc));
    Outs bwd = run_both("moe_combine_bwd " + tag, [&] {
        Dev<T> drows(drows0, skew), dsh(out0, skew), d(dout, skew), y(rows, skew);
        Dev<float> dw((size_t)N * k), w(r.weight);
        Dev<int32_t> slot(r.slot.size());
        std::copy(r.slot.begin(), r.slot.end(), slot.get());
        Ops<T>::moe_combine_bwd(drows, dw, has_s ? dsh.get() : nullptr, d, y, w, slot, scale, N, k,
                                C);
        return Outs{drows.floats(), dw.floats(), dsh.floats()};
    });
    std::vector<float> drows(rc), dw((size_t)N * k), dsh = out0;
    cpu_moe_combine_bwd(drows.data(), dw.data(), has_s ? dsh.data() : nullptr, dout.data(),
                        rows.data(), r.weight.data(), r.slot.data(), scale, N, k, C);
    for (float &v : drows)
        v = nearest<T>(v);
    for (float &v : dsh)
        v = nearest<T>(v);
    // A sum of C products in another order: C ulps of the sum of their magnitudes at most.
    std::vector<double> allowed((size_t)N * k);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            double mag = 0;
            const size_t p = (size_t)r.slot[(size_t)n * k + j];
            for (int c = 0; c < C; c++)
                mag += fabs((double)dout[(size_t)n * C + c] * rows[p * C + c]);
            allowed[(size_t)n * k + j] = 0x1p-24 * C * mag + 1e-30;
        }
    check("moe_combine_bwd " + tag + " drows (exact)", bwd[0], drows, kExact);
    check_within("  dweight (fp32)", bwd[1], dw, allowed);
    check(has_s ? "  dshared (exact)" : "  dshared NULL: untouched", bwd[2], dsh, kExact);
}

template <typename T> void test_moe() {
    test_copy_rows<T>(7, 64, 96, 192, 0); // 16-byte words
    test_copy_rows<T>(5, 37, 40, 37, 0);  // element path
    test_copy_rows<T>(9, 64, 64, 80, 1);
    test_copy_rows<T>(3, 5, 5, 5, 0);

    test_moe_route<T>(300, 16, 4, kRandom);    // N past a block; pairs past a rank chunk
    test_moe_route<T>(130, 64, 6, kRandom);    // nth_element + sort (k * 64 > E)
    test_moe_route<T>(40, 200, 3, kRandom);    // partial_sort (k * 64 <= E)
    test_moe_route<T>(17, 512, 8, kRandom);    // the largest E
    test_moe_route<T>(50, 8, 1, kOneExpert);   // every token to one expert
    test_moe_route<T>(50, 8, 2, kOneExpert);   // ... and one more
    test_moe_route<T>(70, 8, 2, kEmptyExpert); // an expert with no tokens
    test_moe_route<T>(9, 16, 3, kTies);        // exact ties: torch's order decides
    test_moe_route<T>(5, 300, 2, kTies);       // ties through partial_sort's heap
    test_moe_route<T>(33, 4, 4, kRandom);      // k == E
    test_moe_route<T>(1, 3, 1, kRandom);

    test_moe_combine<T>(37, 8, 2, 64, kAll, 0);
    test_moe_combine<T>(13, 6, 3, 40, kAll, 0); // C % 8 != 0: the scalar path for bf16
    test_moe_combine<T>(21, 8, 2, 64, kAll | kInPlace, 0);
    test_moe_combine<T>(21, 8, 2, 64, kWeight, 0);          // no resid, no shared
    test_moe_combine<T>(19, 4, 4, 48, 0, 0);                // the gather-sum (weights 1)
    test_moe_combine<T>(9, 8, 2, 700, kResid | kWeight, 0); // rows past one block's vectors
    test_moe_combine<T>(11, 8, 3, 64, kAll, 1);
}

// A routing the kernels cannot take (E past their top-k scratch) is the backend's recorded
// failure naming the op and the shape, and nothing is written.
static void test_moe_failure_recorded() {
    int status = 0;
    std::string msg = child_stderr(
        [] {
            const int N = 3, E = 600, k = 2;
            Dev<bf16> z(std::vector<float>((size_t)N * E, 0.5f));
            Dev<float> probs(std::vector<float>((size_t)N * E, 7.0f)), weight((size_t)N * k);
            Dev<int32_t> expert((size_t)N * k), counts(E), token_of((size_t)N * k),
                slot((size_t)N * k);
            Err err = {};
            int before = cuda_failure(&err);
            Ops<bf16>::moe_route(probs, weight, expert, counts, token_of, slot, z, N, E, k);
            int after = cuda_failure(&err);
            bool untouched = true;
            for (float x : probs.floats())
                untouched &= x == 7.0f;
            fprintf(stderr, "before %d after %d untouched %d: %s\n", before, after, untouched,
                    err.msg);
        },
        &status);
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
              msg.find("before 0 after -1 untouched 1: cuda backend: moe_route: unsupported "
                       "shape N=3 E=600 k=2") != std::string::npos;
    printf("%-4s a routing over 600 experts is the backend's recorded failure, nothing "
           "launched%s%s\n",
           ok ? "ok" : "FAIL", ok ? "" : ": ", ok ? "" : msg.c_str());
    failures += !ok;
}

// ---------------------------------------------------------------- fp16 overflow

// Where the fp32 result is past fp16's range (|x| >= 65520 rounds to inf), the fp16 output is
// +-inf, never a clamped 65504: the trainer's loss scaling finds an overflowed gradient by its
// inf (and lowers the scale), so a saturating store would hide it. Every 3rd column of the
// swiglu and sigmoid-gate inputs is large, so that some outputs overflow and the others do not;
// cross_entropy_bwd with a loss-scaled dloss of 2e5 overflows at each row's target (and where
// the probability is large). The reference: the CPU's fp32 result, rounded to fp16 (inf past
// the range); each check also requires that infs occurred.
static void check_overflow(const std::string &what, const std::vector<float> &got,
                           std::vector<float> want, Tol tol) {
    size_t infs = 0;
    for (float &w : want) {
        w = nearest<f16>(w);
        infs += std::isinf(w);
    }
    check(fmt("%s (%zu inf)", what.c_str(), infs), got, want, tol);
    if (infs == 0) {
        printf("FAIL %s: no element overflowed\n", what.c_str());
        failures++;
    }
}

static void test_f16_overflow(int N, int FF) {
    std::string tag = fmt("N%d FF%d", N, FF);
    const size_t nh = (size_t)N * 2 * FF, no = (size_t)N * FF;
    std::vector<float> h = randn(nh, 2.0f), d = randn(no, 1000.0f), x = randn(no, 2.0f);
    std::vector<float> g = randn(no, 2.0f), dg = randn(no, 1000.0f);
    for (int n = 0; n < N; n++) // columns 3k: up of either sign, gate positive, both large
        for (int c = 0; c < FF; c += 3) {
            float *up = &h[(size_t)n * 2 * FF + c], *gate = up + FF;
            *up = (c % 2 ? -1.0f : 1.0f) * (300.0f + (float)(rng() % 340));
            *gate = 300.0f + (float)(rng() % 340);
        }
    for (size_t i = 0; i < no; i += 3) { // dout * x / 4 up to 60000 * 40 / 4
        x[i] = (i % 2 ? -1.0f : 1.0f) * (10.0f + (float)(rng() % 30));
        dg[i] = 60000.0f;
        g[i] = (float)(rng() % 3) - 1.0f;
    }
    h = quant<f16>(h), d = quant<f16>(d), x = quant<f16>(x), g = quant<f16>(g);
    dg = quant<f16>(dg);
    Outs got = run_both("fp16 overflow " + tag, [&] {
        Dev<f16> hh(h), out(no), dout(d), dh(nh), xx(x), gg(g), dd(dg), o2(no), dx(no), dgg(no);
        Ops<f16>::swiglu_fwd(out, hh, N, FF);
        Ops<f16>::swiglu_bwd(dh, dout, hh, N, FF);
        Ops<f16>::sigmoid_gate_fwd(o2, xx, gg, no);
        Ops<f16>::sigmoid_gate_bwd(dx, dgg, dd, xx, gg, no);
        return Outs{out.floats(), dh.floats(), o2.floats(), dx.floats(), dgg.floats()};
    });
    std::vector<float> want(no), dwant(nh), gw(no), dxw(no), dgw(no);
    cpu_swiglu_fwd(want.data(), h.data(), N, FF);
    cpu_swiglu_bwd(dwant.data(), d.data(), h.data(), N, FF);
    cpu_sigmoid_gate_fwd(gw.data(), x.data(), g.data(), no);
    cpu_sigmoid_gate_bwd(dxw.data(), dgw.data(), dg.data(), x.data(), g.data(), no);
    const Tol tol = out_tol<f16>({2e-6, 1e-30, 1e-7});
    check_overflow("swiglu_fwd f16 overflow " + tag, got[0], want, tol);
    check_overflow("swiglu_bwd f16 overflow " + tag, got[1], dwant, tol);
    // x * sigmoid(g) and dout * sigmoid(g) stay within |x|, |dout|: finite.
    check("sigmoid_gate_fwd f16 overflow " + tag + " (finite)", got[2], gw, tol);
    check("  dx (finite)", got[3], dxw, tol);
    check_overflow("  dg", got[4], dgw, tol);

    const int V = 1000;
    std::vector<float> z = quant<f16>(randn((size_t)N * V, 3.0f));
    std::vector<int32_t> t = randi(N, V), m(N, 1);
    const float dloss = 2e5f;
    Outs ce = run_both("fp16 overflow cross_entropy " + tag, [&] {
        Dev<f16> zz(z), dz((size_t)N * V);
        Dev<int32_t> tt(N), mm(N);
        std::copy(t.begin(), t.end(), tt.get());
        std::copy(m.begin(), m.end(), mm.get());
        Dev<float> loss(N), lse(N);
        Ops<f16>::cross_entropy_fwd(loss, lse, zz, tt, mm, N, V, 0.1f);
        Ops<f16>::cross_entropy_bwd(dz, zz, lse, tt, mm, nullptr, N, V, 0.1f, dloss);
        return Outs{dz.floats()};
    });
    std::vector<float> loss(N), lse(N), dz((size_t)N * V);
    cpu_cross_entropy_fwd(loss.data(), lse.data(), z.data(), t.data(), m.data(), N, V, 0.1f);
    cpu_cross_entropy_bwd(dz.data(), z.data(), lse.data(), t.data(), m.data(), nullptr, N, V, 0.1f,
                          dloss);
    check_overflow(fmt("cross_entropy_bwd f16 overflow N%d V%d dloss %g", N, V, dloss), ce[0], dz,
                   out_tol<f16>({2e-5, 1e-9, 0}));
}

// ---------------------------------------------------------------- main

template <typename T> void test_dtype() {
    test_embedding<T>(37, 64, 30, 0);
    test_embedding<T>(45, 300, 20, 0);
    test_embedding<T>(20, 30, 10, 0);
    test_embedding<T>(20, 64, 10, 1);

    test_rmsnorm<T>(13, 3, 64, 3 * 64 + 16, 0); // qk-norm layout: groups with gaps
    test_rmsnorm<T>(9, 2, 40, 90, 0);           // C % 8 != 0: bf16 scalar path
    test_rmsnorm<T>(7, 3, 37, 120, 0);
    test_rmsnorm<T>(6, 2, 32, 64, 0, 1, 0.5f); // eps that counts
    test_rmsnorm<T>(9, 1, 1000, 1000, 0);
    test_rmsnorm<T>(300, 4, 64, 256, 0); // many row blocks for dweight
    // The dweight partials run ~2048 blocks of 256 threads here (kDwTargetBlocks): one
    // accumulate_dinp each keeps the time down.
    test_rmsnorm<T>(13, 1, 8192, 8192, 0, 1);
    test_rmsnorm<T>(50, 2, 4096, 8192, 0, 2); // dweight: several rows a row lane
    test_rmsnorm<T>(13, 3, 64, 3 * 64 + 16, 1);

    test_rope<T>(5, 3, 64, 3 * 64 + 10, 0);
    test_rope<T>(4, 2, 6, 13, 0);
    test_rope<T>(3, 40, 128, 40 * 128, 1);

    test_swiglu<T>(7, 40, 0);
    test_swiglu<T>(5, 37, 0);
    test_swiglu<T>(3, 2100, 0);
    test_swiglu<T>(3, 64, 1);
    test_sigmoid_gate<T>(1000, 0);
    test_sigmoid_gate<T>(1001, 0);
    test_sigmoid_gate<T>(4096, 1);
    test_casts<T>(1000, 0);
    test_casts<T>(13, 0);
    test_casts<T>(64, 1);

    test_cross_entropy<T>(6, 1000, 0.1f, 0);
    test_cross_entropy<T>(5, 999, 0.0f, 0);
    test_cross_entropy<T>(4, 5000, 0.2f, 0);
    test_cross_entropy<T>(3, 7, 0.1f, 0);
    test_cross_entropy<T>(4, 1024, 0.1f, 1);
    test_cross_entropy<T>(6, 1000, 0.0f, 0, 1);
    test_noise<T>(100000);
}

// engine/backend.h's failure rule: an attention the kernels cannot take (head_dim 300, past the
// SIMT kernels' shared memory) is the backend's recorded failure naming the op and the reason,
// its output left as it was (nothing launched), and the first failure is the one reported. In a
// child process: the record is the process's.
static void test_failure_recorded() {
    int status = 0;
    std::string msg = child_stderr(
        [] {
            const int B = 1, T = 3, H = 2, KVH = 1, D = 300, S = (H + 2 * KVH) * D;
            Dev<bf16> qkv(std::vector<float>((size_t)T * S, 0.5f));
            Dev<bf16> o(std::vector<float>((size_t)T * H * D, 7.0f));
            Dev<float> l((size_t)H * T);
            Dev<int32_t> ds(T);
            std::fill(ds.get(), ds.get() + T, 0);
            Err err = {};
            int before = cuda_failure(&err);
            for (int call = 0; call < 2; call++)
                Ops<bf16>::attention_fwd(o, l, qkv, qkv.get() + H * D, qkv.get() + (H + KVH) * D,
                                         ds, call ? 2 : B, T, H, KVH, D, S);
            int after = cuda_failure(&err);
            bool untouched = true;
            for (float x : o.floats())
                untouched &= x == 7.0f;
            fprintf(stderr, "before %d after %d untouched %d: %s\n", before, after, untouched,
                    err.msg);
        },
        &status);
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
              msg.find("before 0 after -1 untouched 1: cuda backend: attention_fwd: head_dim 300 "
                       "unsupported") != std::string::npos &&
              msg.find("B=2") == std::string::npos;
    printf("%-4s an attention of head_dim 300 is the backend's recorded failure, nothing "
           "launched%s%s\n",
           ok ? "ok" : "FAIL", ok ? "" : ": ", ok ? "" : msg.c_str());
    failures += !ok;
}

int main() {
    setvbuf(stdout, NULL, _IOLBF, 0); // in order with the emulator's messages on stderr
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_dtype<float>();
    test_dtype<bf16>();
    test_loss_mean(1000);
    test_loss_mean(7);
    test_dpo_loss(3, 50);
    test_dpo_loss(2, 1500); // rows longer than the block
    test_grpo_loss(8, 40);
    test_grpo_loss(4, 700);
    test_sum_squares_scale(1000);
    test_sum_squares_scale(100001);
    test_adamw(1000);
    test_adamw(70001);
    test_muon(40, 70);
    test_muon(70, 40);
    test_muon(33, 33);
    test_ldmatrix();
    test_mma(false);
    test_cp_async();
    test_ptx_errors();
    test_fallback_said<bf16>(); // first: the reasons are said once per process
    test_attention_all();
    // fp16 last: the random inputs of everything before are those they always had.
    test_dtype<f16>();
    test_f16_overflow(5, 64);
    test_f16_overflow(3, 37);
    test_mma(true);
    test_fallback_said<f16>();
    test_attention_f16();
    test_failure_recorded();
    // MoE last, each dtype: the random inputs of everything before are those they always had.
    test_moe<float>();
    test_moe<bf16>();
    test_moe<f16>();
    test_moe_failure_recorded();
    test_attention_decode_all();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const emu::Stats &s = emu::stats_now();
    printf("%llu launches, %llu CUDA threads, %llu fiber switches, %llu block barriers; "
           "scratch peak %zu bytes; %.1f s\n",
           s.launches, s.threads, s.switches, s.barriers, emu_scratch_peak,
           (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec));
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
