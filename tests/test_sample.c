// test_sample: engine/sample.h against direct implementations of each strategy (a full sort
// where sample.c selects, a count per vocabulary entry where it counts the history), greedy as
// argmax, the draws' determinism and independence, and chi-square tests of the draws'
// frequencies against the final distribution.
//
//   test_sample            the unit tests
//   test_sample dump       reads cases from stdin, writes results, for tests/test_sample.py
//
// dump's records, native-endian: int32 V, float32 temperature, int32 top_k, float32 top_p,
// float32 frequency_penalty, int32 rep_window, uint64 seed, uint64 sequence, uint64 position,
// int32 n_prompt, int32 n_output, then n_prompt + n_output int32 tokens and V float32 logits;
// for each, int32 status (0 or -1), then V float32 final logits (sample_transform), int32 token
// and float32 logprob (sample_token) and float32 model logprob (sample_model_logprob).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/splitmix64.h"
#include "engine/sample.h"

// The direct implementations round each step as engine/sample.c does (no fused multiply-add).
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

// ---------------------------------------------------------------- helpers

static uint64_t rng_state = 12345;

static double unif(void) {
    return (double)(splitmix64_next(&rng_state) >> 11) * 0x1.0p-53;
}

static int irand(int n) {
    return (int)(unif() * n);
}

// Random logits: continuous, or drawn from a few levels (ties everywhere), some -inf.
static void random_logits(float *x, int V, int kind) {
    static const float levels[] = {-1.0f, 0.0f, 0.5f, 2.0f};
    for (int i = 0; i < V; i++) {
        if (kind == 0)
            x[i] = (float)(4.0 * (unif() - 0.5));
        else
            x[i] = levels[irand(4)];
        if (kind == 2 && unif() < 0.2) x[i] = -INFINITY;
    }
    if (kind == 2) x[irand(V)] = 1.0f; // at least one finite
}

static void *new_scratch(int V) {
    size_t n = sample_scratch_bytes(V);
    unsigned char *s = malloc(n);
    if (!s) exit(2);
    memset(s, 0xa5, n); // garbage: sample.h says scratch needs no initialisation
    return s;
}

static int same_floats(const float *a, const float *b, int n) {
    for (int i = 0; i < n; i++)
        if (!(a[i] == b[i] || (isnan(a[i]) && isnan(b[i])))) return 0;
    return 1;
}

static SampleOptions opts(float t, int k, float p, float f, int window) {
    SampleOptions o = SAMPLE_OPTIONS_DEFAULT;
    o.temperature = t;
    o.top_k = k;
    o.top_p = p;
    o.frequency_penalty = f;
    o.rep_window = window;
    return o;
}

// ---------------------------------------------------------------- direct implementations

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x > y ? -1 : x < y ? 1 : 0;
}

// Every value below the k-th of the descending sort removed.
static void direct_top_k(float *w, int V, int k) {
    if (k <= 0 || k >= V) return;
    float *s = malloc(sizeof(float) * (size_t)V);
    memcpy(s, w, sizeof(float) * (size_t)V);
    qsort(s, (size_t)V, sizeof(float), cmp_desc);
    for (int i = 0; i < V; i++)
        if (w[i] < s[k - 1]) w[i] = -INFINITY;
    free(s);
}

static const float *sort_keys;
static int cmp_index(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    float x = sort_keys[i], y = sort_keys[j];
    if (x != y) return x > y ? -1 : 1;
    return i < j ? -1 : i > j ? 1 : 0; // a stable descending sort
}

// The whole vocabulary sorted (descending, stably), softmax in double, and a token kept while
// the probability before it is <= p.
static void direct_top_p(float *w, int V, float p) {
    if (p >= 1.0f) return;
    int *ord = malloc(sizeof(int) * (size_t)V);
    for (int i = 0; i < V; i++)
        ord[i] = i;
    sort_keys = w;
    qsort(ord, (size_t)V, sizeof(int), cmp_index);
    float mx = w[ord[0]];
    double Z = 0.0;
    for (int i = 0; i < V; i++)
        if (w[i] != -INFINITY) Z += exp((double)w[i] - mx);
    double cum = 0.0;
    for (int r = 0; r < V; r++) {
        int i = ord[r];
        double pr = w[i] == -INFINITY ? 0.0 : exp((double)w[i] - mx) / Z;
        if (cum > p) w[i] = -INFINITY;
        cum += pr;
    }
    free(ord);
}

// For each vocabulary entry, its count among the prompt's last `window` and all the output.
static void direct_penalty(float *w, int V, float f, int window, const int32_t *prompt, int np,
                           const int32_t *output, int no) {
    if (f == 0.0f) return;
    for (int t = 0; t < V; t++) {
        int c = 0;
        for (int j = np - window < 0 ? 0 : np - window; j < np; j++)
            c += prompt[j] == t;
        for (int j = 0; j < no; j++)
            c += output[j] == t;
        if (c > 0 && w[t] != -INFINITY) w[t] -= f * (float)c;
    }
}

static void direct_pipeline(const SampleOptions *o, const float *logits, int V, float *w,
                            const SampleHistory *h) {
    for (int i = 0; i < V; i++)
        w[i] = o->temperature == 1.0f ? logits[i] : logits[i] / fmaxf(o->temperature, 1e-8f);
    direct_top_k(w, V, o->top_k);
    direct_top_p(w, V, o->top_p);
    if (h)
        direct_penalty(w, V, o->frequency_penalty, o->rep_window, h->prompt, h->n_prompt, h->output,
                       h->n_output);
}

static int direct_argmax(const float *x, int V) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

// A float log-prob against the double one: within 1e-6, relative where it is large.
#define CHECK_ABS(a, b)                                                                            \
    CHECK_MSG(fabs((double)(a) - (b)) <= 1e-6 * fmax(1.0, fabs(b)), "%.9g vs %.9g", (double)(a),   \
              (b))

static double direct_logprob(const float *w, int V, int t) {
    double mx = -INFINITY, Z = 0.0;
    for (int i = 0; i < V; i++)
        mx = fmax(mx, w[i]);
    for (int i = 0; i < V; i++)
        Z += exp((double)w[i] - mx);
    return (double)w[t] - mx - log(Z);
}

// ---------------------------------------------------------------- validation

static void expect_error(int rc, const Err *err, const char *needle) {
    CHECK_MSG(rc == -1 && strstr(err->msg, needle), "rc %d, message '%s', wanted '%s'", rc,
              err->msg, needle);
}

static void test_options(void) {
    Err err = {0};
    SampleOptions ok = SAMPLE_OPTIONS_DEFAULT;
    CHECK(sample_options_check(&ok, &err) == 0);
    struct {
        SampleOptions o;
        const char *needle;
    } bad[] = {
        {opts(-0.5f, 0, 1.0f, 0.0f, 64), "temperature -0.5"},
        {opts(NAN, 0, 1.0f, 0.0f, 64), "temperature nan"},
        {opts(INFINITY, 0, 1.0f, 0.0f, 64), "temperature inf"},
        {opts(1.0f, -1, 1.0f, 0.0f, 64), "top_k -1"},
        {opts(1.0f, 0, 0.0f, 0.0f, 64), "top_p 0"},
        {opts(1.0f, 0, 1.5f, 0.0f, 64), "top_p 1.5"},
        {opts(1.0f, 0, -0.25f, 0.0f, 64), "top_p -0.25"},
        {opts(1.0f, 0, NAN, 0.0f, 64), "top_p nan"},
        {opts(1.0f, 0, 1.0f, NAN, 64), "frequency_penalty nan"},
        {opts(1.0f, 0, 1.0f, -INFINITY, 64), "frequency_penalty -inf"},
        {opts(1.0f, 0, 1.0f, 0.0f, -3), "rep_window -3"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++)
        expect_error(sample_options_check(&bad[c].o, &err), &err, bad[c].needle);

    // Bad input to the sampler itself, named.
    float x[4] = {0.0f, 1.0f, NAN, 2.0f}, out[4];
    void *s = new_scratch(4);
    int32_t tok;
    float lp;
    expect_error(sample_transform(&ok, x, 4, NULL, s, out, &err), &err, "logits[2] = nan");
    x[2] = INFINITY;
    expect_error(sample_token(&ok, x, 4, NULL, 0, 0, s, &tok, &lp, &err), &err, "logits[2] = inf");
    for (int i = 0; i < 4; i++)
        x[i] = -INFINITY;
    expect_error(sample_token(&ok, x, 4, NULL, 0, 0, s, &tok, &lp, &err), &err, "all 4 are -inf");
    expect_error(sample_token(&ok, x, 0, NULL, 0, 0, s, &tok, &lp, &err), &err,
                 "vocabulary size 0");
    x[0] = 1.0f;
    int32_t prompt[2] = {1, 9}, output[1] = {-1};
    SampleHistory h = {prompt, 2, NULL, 0};
    expect_error(sample_token(&ok, x, 4, &h, 0, 0, s, &tok, &lp, &err), &err, "prompt[1] = 9");
    h = (SampleHistory){NULL, 0, output, 1};
    expect_error(sample_token(&ok, x, 4, &h, 0, 0, s, &tok, &lp, &err), &err, "output[0] = -1");
    expect_error(sample_model_logprob(x, 4, 4, &lp, &err), &err, "token 4");
    // A negative penalty pushing a logit past the float range.
    SampleOptions huge = opts(1.0f, 0, 1.0f, -3e38f, 64);
    float y[2] = {3e38f, 0.0f};
    int32_t rep[2] = {0, 0};
    h = (SampleHistory){rep, 2, NULL, 0};
    expect_error(sample_token(&huge, y, 2, &h, 0, 0, s, &tok, &lp, &err), &err,
                 "token 0's penalised logit overflows");
    free(s);
}

// ---------------------------------------------------------------- each strategy

// One strategy (or all) through sample_transform against the direct pipeline, bit for bit.
static void check_transform(const SampleOptions *o, const float *logits, int V,
                            const SampleHistory *h, const char *what) {
    float *got = malloc(sizeof(float) * (size_t)V), *want = malloc(sizeof(float) * (size_t)V);
    void *s = new_scratch(V);
    Err err = {0};
    int rc = sample_transform(o, logits, V, h, s, got, &err);
    CHECK_MSG(rc == 0, "%s: %s", what, err.msg);
    direct_pipeline(o, logits, V, want, h);
    CHECK_MSG(rc || same_floats(got, want, V), "%s: V %d t %g k %d p %g f %g window %d", what, V,
              (double)o->temperature, o->top_k, (double)o->top_p, (double)o->frequency_penalty,
              o->rep_window);
    free(got);
    free(want);
    free(s);
}

static const int VS[] = {1, 2, 3, 5, 17, 64, 65, 100, 700, 5000};
#define NV (int)(sizeof VS / sizeof VS[0])

static void test_temperature(void) {
    static const float ts[] = {1.0f, 0.5f, 0.7f, 2.0f, 1e-3f, 1e-9f};
    float x[700];
    for (int kind = 0; kind < 3; kind++)
        for (size_t a = 0; a < sizeof ts / sizeof ts[0]; a++) {
            random_logits(x, 700, kind);
            SampleOptions o = opts(ts[a], 0, 1.0f, 0.0f, 64);
            check_transform(&o, x, 700, NULL, "temperature");
        }
    // 1e-9 is clamped to 1e-8, as AstrAI clamps it.
    float one[1] = {1.0f}, out[1];
    void *s = new_scratch(1);
    Err err = {0};
    SampleOptions o = opts(1e-9f, 0, 1.0f, 0.0f, 64);
    CHECK(sample_transform(&o, one, 1, NULL, s, out, &err) == 0 && out[0] == 1.0f / 1e-8f);
    free(s);
}

static void test_top_k(void) {
    for (int v = 0; v < NV; v++) {
        int V = VS[v];
        float *x = malloc(sizeof(float) * (size_t)V);
        int ks[] = {1, 2, 3, V / 2, V - 1, V, V + 5};
        for (int kind = 0; kind < 3; kind++)
            for (size_t a = 0; a < sizeof ks / sizeof ks[0]; a++) {
                if (ks[a] < 1) continue;
                random_logits(x, V, kind);
                SampleOptions o = opts(1.0f, ks[a], 1.0f, 0.0f, 64);
                check_transform(&o, x, V, NULL, "top-k");
            }
        free(x);
    }
    // Ties with the k-th all stay: k = 2 over {3, 1, 3, 3, 0} keeps the three 3s.
    float x[5] = {3, 1, 3, 3, 0}, out[5];
    void *s = new_scratch(5);
    Err err = {0};
    SampleOptions o = opts(1.0f, 2, 1.0f, 0.0f, 64);
    CHECK(sample_transform(&o, x, 5, NULL, s, out, &err) == 0);
    CHECK(out[0] == 3 && out[2] == 3 && out[3] == 3 && out[1] == -INFINITY && out[4] == -INFINITY);
    free(s);
}

static void test_top_p(void) {
    static const float ps[] = {0.05f, 0.3f, 0.5f, 0.9f, 0.95f, 0.999f, 1.0f};
    for (int v = 0; v < NV; v++) {
        int V = VS[v];
        float *x = malloc(sizeof(float) * (size_t)V);
        for (int kind = 0; kind < 3; kind++)
            for (size_t a = 0; a < sizeof ps / sizeof ps[0]; a++) {
                random_logits(x, V, kind);
                SampleOptions o = opts(1.0f, 0, ps[a], 0.0f, 64);
                check_transform(&o, x, V, NULL, "top-p");
            }
        free(x);
    }
    // Many boundaries: random sizes, temperatures and p.
    float *r = malloc(sizeof(float) * 4000);
    for (int c = 0; c < 2000; c++) { // small ones often end the nucleus on a pivot
        int V = c % 4 ? 17 + irand(60) : 100 + irand(3900);
        random_logits(r, V, c % 3);
        SampleOptions o =
            opts(0.3f + 2.0f * (float)unif(), 0, 0.001f + 0.998f * (float)unif(), 0.0f, 64);
        check_transform(&o, r, V, NULL, "top-p, random p");
    }
    free(r);
    float out[8];
    void *s = new_scratch(8);
    Err err = {0};
    // Probabilities .5 .3 .2: p = 0.6 keeps the token that crosses it (2 tokens); p = 0.45
    // keeps only the first, whose own probability exceeds p.
    float x[3] = {logf(0.2f), logf(0.5f), logf(0.3f)};
    SampleOptions o = opts(1.0f, 0, 0.6f, 0.0f, 64);
    CHECK(sample_transform(&o, x, 3, NULL, s, out, &err) == 0);
    CHECK(out[1] == x[1] && out[2] == x[2] && out[0] == -INFINITY);
    o.top_p = 0.45f;
    CHECK(sample_transform(&o, x, 3, NULL, s, out, &err) == 0);
    CHECK(out[1] == x[1] && out[0] == -INFINITY && out[2] == -INFINITY);
    // Ties at the boundary: four equal logits (1/4 each of the tied mass, with a small rest),
    // p = 0.4 needs two of them: the two lowest indices, 1 and 3, stay.
    float t[8] = {-9, 2, -9, 2, -9, 2, -9, 2};
    o.top_p = 0.4f;
    CHECK(sample_transform(&o, t, 8, NULL, s, out, &err) == 0);
    CHECK(out[1] == 2 && out[3] == 2 && out[5] == -INFINITY && out[7] == -INFINITY);
    for (int i = 0; i < 8; i += 2)
        CHECK(out[i] == -INFINITY);
    free(s);
}

static void test_penalty(void) {
    int32_t prompt[40], output[30];
    for (int v = 0; v < NV; v++) {
        int V = VS[v];
        float *x = malloc(sizeof(float) * (size_t)V);
        for (int c = 0; c < 12; c++) {
            int np = irand(41), no = irand(31);
            int span = V < 6 ? V : 6; // few distinct tokens: repeats
            for (int j = 0; j < np; j++)
                prompt[j] = irand(span);
            for (int j = 0; j < no; j++)
                output[j] = irand(span) + (V > 8 ? 2 : 0);
            static const int windows[] = {0, 1, 5, 39, 40, 64};
            static const float fs[] = {0.5f, -0.7f, 2.0f, 1.25f};
            random_logits(x, V, c % 3);
            SampleHistory h = {prompt, np, output, no};
            SampleOptions o = opts(1.0f, 0, 1.0f, fs[c % 4], windows[c % 6]);
            check_transform(&o, x, V, &h, "penalty");
            // After truncation, on the tempered logits: removed tokens stay removed.
            o = opts(0.8f, 3, 0.9f, fs[c % 4], windows[c % 6]);
            check_transform(&o, x, V, &h, "temperature, top-k, top-p, penalty");
        }
        free(x);
    }
    // The window is the prompt's last rep_window tokens, and all of the output.
    float x[4] = {0, 0, 0, 0}, out[4];
    int32_t p4[4] = {0, 0, 1, 2}, o3[3] = {3, 3, 0};
    SampleHistory h = {p4, 4, o3, 3};
    SampleOptions o = opts(1.0f, 0, 1.0f, 0.5f, 2);
    void *s = new_scratch(4);
    Err err = {0};
    CHECK(sample_transform(&o, x, 4, &h, s, out, &err) == 0);
    CHECK(out[0] == -0.5f && out[1] == -0.5f && out[2] == -0.5f && out[3] == -1.0f);
    o.rep_window = 0; // none of the prompt
    CHECK(sample_transform(&o, x, 4, &h, s, out, &err) == 0);
    CHECK(out[0] == -0.5f && out[1] == 0.0f && out[2] == 0.0f && out[3] == -1.0f);
    free(s);
}

// ---------------------------------------------------------------- greedy, log-probs

static void test_greedy(void) {
    float x[100], out[100];
    void *s = new_scratch(100);
    Err err = {0};
    int32_t output[5] = {0, 1, 2, 3, 4};
    SampleHistory h = {NULL, 0, output, 5};
    for (int c = 0; c < 60; c++) {
        random_logits(x, 100, c % 3);
        SampleOptions o = opts(0.0f, c % 4, c % 2 ? 0.5f : 1.0f, 1.5f, 64);
        int32_t tok = -1;
        float lp = 1.0f;
        CHECK(sample_token(&o, x, 100, &h, (uint64_t)c, 7, s, &tok, &lp, &err) == 0);
        // argmax of the raw logits, ties to the lowest index; the penalty and truncation do
        // not move it; the point mass's log-prob is 0
        CHECK(tok == direct_argmax(x, 100) && lp == 0.0f);
        CHECK(sample_transform(&o, x, 100, &h, s, out, &err) == 0);
        for (int i = 0; i < 100; i++)
            CHECK(out[i] == (i == tok ? 0.0f : -INFINITY));
    }
    float ties[4] = {1, 3, 3, 3};
    SampleOptions o = opts(0.0f, 0, 1.0f, 0.0f, 64);
    int32_t tok;
    float lp;
    CHECK(sample_token(&o, ties, 4, NULL, 0, 0, s, &tok, &lp, &err) == 0 && tok == 1);
    free(s);
}

static void test_logprobs(void) {
    float x[300], w[300];
    void *s = new_scratch(300);
    Err err = {0};
    int32_t output[20];
    for (int j = 0; j < 20; j++)
        output[j] = irand(10);
    SampleHistory h = {NULL, 0, output, 20};
    for (int c = 0; c < 200; c++) {
        random_logits(x, 300, c % 3);
        SampleOptions o =
            opts(0.3f + 0.01f * (float)c, c % 7 * 10, c % 5 ? 0.8f : 1.0f, c % 2 ? 0.4f : 0.0f, 64);
        int32_t tok;
        float lp, model;
        CHECK(sample_token(&o, x, 300, &h, 3, (uint64_t)c, s, &tok, &lp, &err) == 0);
        direct_pipeline(&o, x, 300, w, &h);
        CHECK(w[tok] != -INFINITY); // never a removed token
        CHECK_ABS(lp, direct_logprob(w, 300, tok));
        CHECK(sample_model_logprob(x, 300, tok, &model, &err) == 0);
        CHECK_ABS(model, direct_logprob(x, 300, tok));
    }
    free(s);
}

// ---------------------------------------------------------------- determinism

static void test_determinism(void) {
    enum { V = 50, N = 4000 };
    float x[V];
    random_logits(x, V, 0);
    SampleOptions o = opts(1.0f, 0, 1.0f, 0.0f, 64);
    o.seed = 77;
    void *s1 = new_scratch(V), *s2 = new_scratch(V);
    Err err = {0};
    double p[V], sum_sq = 0.0;
    {
        double mx = x[direct_argmax(x, V)], Z = 0.0;
        for (int i = 0; i < V; i++)
            Z += exp((double)x[i] - mx);
        for (int i = 0; i < V; i++) {
            p[i] = exp((double)x[i] - mx) / Z;
            sum_sq += p[i] * p[i];
        }
    }
    int same_seq = 0, same_shift = 0, same_seed = 0, mismatch = 0;
    for (int pos = 1; pos <= N; pos++) {
        int32_t a, b, c, d, e;
        float la, lb;
        sample_token(&o, x, V, NULL, 5, (uint64_t)pos, s1, &a, &la, &err);
        memset(s2, pos & 0xff, sample_scratch_bytes(V)); // other garbage, same answer
        sample_token(&o, x, V, NULL, 5, (uint64_t)pos, s2, &b, &lb, &err);
        mismatch += a != b || la != lb;
        sample_token(&o, x, V, NULL, 6, (uint64_t)pos, s1, &c, &la, &err);
        sample_token(&o, x, V, NULL, 6, (uint64_t)pos - 1, s1, &d, &la, &err);
        SampleOptions o2 = o;
        o2.seed = 78;
        sample_token(&o2, x, V, NULL, 5, (uint64_t)pos, s1, &e, &la, &err);
        same_seq += a == c;   // the next sequence, same position
        same_shift += a == d; // the next sequence, one position back
        same_seed += a == e;  // another seed
    }
    CHECK(mismatch == 0);
    // Independent draws agree with probability sum p^2; each count is binomial(N, sum p^2):
    // within 6 standard deviations (a false alarm about once in 5e8).
    double mean = N * sum_sq, sd = sqrt(N * sum_sq * (1.0 - sum_sq));
    int counts[3] = {same_seq, same_shift, same_seed};
    for (int c = 0; c < 3; c++)
        CHECK_MSG(fabs(counts[c] - mean) <= 6.0 * sd, "agreement %d of %d, expected %.1f +- %.1f",
                  counts[c], N, mean, sd);
    // The uniform is a pure function of its key.
    CHECK(sample_uniform(1, 2, 3) == sample_uniform(1, 2, 3));
    CHECK(sample_uniform(1, 2, 3) != sample_uniform(1, 3, 2));
    free(s1);
    free(s2);
}

// ---------------------------------------------------------------- chi-square

// P(chi2_df >= x) for even df: e^{-x/2} sum_{j < df/2} (x/2)^j / j!.
static double chi2_sf_even(double x, int df) {
    double term = 1.0, sum = 1.0;
    for (int j = 1; j < df / 2; j++)
        sum += (term *= (x / 2) / j);
    return exp(-x / 2) * sum;
}

// Pearson's chi-square p-value of counts (n categories) against probabilities p (summing to 1
// over the categories with p > 0; those with p == 0 must have no draws). Categories expecting
// fewer than 5 draws are pooled, and the two smallest pooled when the degrees of freedom come
// out odd, so that chi2_sf_even applies.
static double chi2_pvalue(const long *counts, const double *p, int n, long draws) {
    double e[64], o[64];
    int m = 0;
    double pool_e = 0.0, pool_o = 0.0;
    for (int i = 0; i < n; i++) {
        if (p[i] == 0.0) {
            if (counts[i]) return 0.0; // a removed token was drawn
            continue;
        }
        if (p[i] * draws < 5.0) {
            pool_e += p[i] * draws;
            pool_o += (double)counts[i];
        } else {
            e[m] = p[i] * draws;
            o[m++] = (double)counts[i];
        }
    }
    if (pool_e > 0.0) {
        e[m] = pool_e;
        o[m++] = pool_o;
    }
    if ((m - 1) % 2) { // merge the two smallest expectations
        int a = 0;
        for (int i = 1; i < m; i++)
            if (e[i] < e[a]) a = i;
        int b = a == 0 ? 1 : 0;
        for (int i = 0; i < m; i++)
            if (i != a && e[i] < e[b]) b = i;
        e[a] += e[b];
        o[a] += o[b];
        e[b] = e[m - 1];
        o[b] = o[--m];
    }
    double x2 = 0.0;
    for (int i = 0; i < m; i++)
        x2 += (o[i] - e[i]) * (o[i] - e[i]) / e[i];
    return m < 2 ? 1.0 : chi2_sf_even(x2, m - 1);
}

// The final distribution of o on x, in double.
static void final_probs(const SampleOptions *o, const float *x, int V, const SampleHistory *h,
                        double *p) {
    float w[64];
    direct_pipeline(o, x, V, w, h);
    double mx = -INFINITY, Z = 0.0;
    for (int i = 0; i < V; i++)
        mx = fmax(mx, w[i]);
    for (int i = 0; i < V; i++)
        Z += exp((double)w[i] - mx);
    for (int i = 0; i < V; i++)
        p[i] = exp((double)w[i] - mx) / Z;
}

// Draws at positions 0..N-1 of one sequence (by_sequence 0), or position 0 of sequences
// 0..N-1, tested at false-alarm rate 1e-6 each (the seeds are fixed: the outcome is too).
static void chi2_case(const char *what, const SampleOptions *o, const float *x, int V,
                      const SampleHistory *h, int by_sequence) {
    enum { N = 200000 };
    long counts[64] = {0};
    double p[64];
    void *s = new_scratch(V);
    Err err = {0};
    final_probs(o, x, V, h, p);
    for (long d = 0; d < N; d++) {
        int32_t tok;
        float lp;
        uint64_t seq = by_sequence ? (uint64_t)d : 11, pos = by_sequence ? 0 : (uint64_t)d;
        if (sample_token(o, x, V, h, seq, pos, s, &tok, &lp, &err)) {
            CHECK_MSG(0, "%s: %s", what, err.msg);
            break;
        }
        counts[tok]++;
    }
    double pv = chi2_pvalue(counts, p, V, N);
    printf("chi-square %-40s p-value %.4g\n", what, pv);
    CHECK_MSG(pv > 1e-6, "%s: p-value %g", what, pv);
    free(s);
}

static void test_chi_square(void) {
    float x[7] = {0.1f, 1.5f, -0.7f, 0.9f, 2.2f, -2.0f, 0.0f};
    SampleOptions plain = opts(1.0f, 0, 1.0f, 0.0f, 64);
    plain.seed = 2024;
    chi2_case("7 tokens, along a sequence", &plain, x, 7, NULL, 0);
    chi2_case("7 tokens, across sequences", &plain, x, 7, NULL, 1);
    float y[24];
    for (int i = 0; i < 24; i++)
        y[i] = (float)sin(1.7 * i) * 2.0f;
    int32_t output[6] = {3, 3, 9, 12, 12, 12}, prompt[3] = {7, 9, 1};
    SampleHistory h = {prompt, 3, output, 6};
    SampleOptions all = opts(0.7f, 10, 0.85f, 0.3f, 2);
    all.seed = 99;
    chi2_case("24 tokens, t 0.7, top-k 10, top-p 0.85, penalty", &all, y, 24, &h, 0);
    SampleOptions hot = opts(1.6f, 0, 1.0f, -0.5f, 64);
    hot.seed = 5;
    chi2_case("24 tokens, t 1.6, negative penalty", &hot, y, 24, &h, 1);
}

// ---------------------------------------------------------------- dump (test_sample.py)

static int read_all(void *p, size_t size, size_t n) {
    return fread(p, size, n, stdin) == n;
}

static int dump_record(void) {
    int32_t V, k, window, np, no;
    float t, p, f;
    uint64_t seed, seq, pos;
    if (!read_all(&V, 4, 1)) return -1;
    if (!read_all(&t, 4, 1) || !read_all(&k, 4, 1) || !read_all(&p, 4, 1) || !read_all(&f, 4, 1) ||
        !read_all(&window, 4, 1) || !read_all(&seed, 8, 1) || !read_all(&seq, 8, 1) ||
        !read_all(&pos, 8, 1) || !read_all(&np, 4, 1) || !read_all(&no, 4, 1) || V < 1 || np < 0 ||
        no < 0) {
        fprintf(stderr, "test_sample dump: bad record\n");
        exit(2);
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(np + no + 1));
    float *x = malloc(sizeof(float) * (size_t)V), *out = malloc(sizeof(float) * (size_t)V);
    void *s = new_scratch(V);
    if (!read_all(ids, 4, (size_t)(np + no)) || !read_all(x, 4, (size_t)V)) {
        fprintf(stderr, "test_sample dump: short record\n");
        exit(2);
    }
    SampleOptions o = {t, k, p, f, window, seed};
    SampleHistory h = {ids, np, ids + np, no};
    Err err = {0};
    int32_t tok = -1;
    float lp = NAN, model = NAN;
    int32_t rc = sample_transform(&o, x, V, &h, s, out, &err);
    if (rc == 0) rc = sample_token(&o, x, V, &h, seq, pos, s, &tok, &lp, &err);
    if (rc == 0) rc = sample_model_logprob(x, V, tok, &model, &err);
    if (rc) fprintf(stderr, "test_sample dump: %s\n", err.msg);
    fwrite(&rc, 4, 1, stdout);
    fwrite(out, 4, (size_t)V, stdout);
    fwrite(&tok, 4, 1, stdout);
    fwrite(&lp, 4, 1, stdout);
    fwrite(&model, 4, 1, stdout);
    free(ids);
    free(x);
    free(out);
    free(s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "dump")) {
        while (dump_record() == 0) {
        }
        return fflush(stdout) ? 1 : 0;
    }
    if (argc > 1) {
        fprintf(stderr, "usage: test_sample [dump]\n");
        return 2;
    }
    test_options();
    test_temperature();
    test_top_k();
    test_top_p();
    test_penalty();
    test_greedy();
    test_logprobs();
    test_determinism();
    test_chi_square();
    CHECK_DONE();
}
