// sample.c: AstrAI's sampling strategies on one position's logits (engine/sample.h says which
// lines of AstrAI each step matches, and where it departs).
//
// Cost per token for a vocabulary V: O(V) for the temperature, the top-k and top-p selections
// (no sort of the vocabulary or of the nucleus) and the draw, O(history) for the penalty.
#include "engine/sample.h"

#include <math.h>
#include <stdlib.h>

// Each step rounds as torch's separate tensor ops do: no fused multiply-add across them (clang
// contracts a * b + c by default; gcc in ISO C mode does not).
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

// A logit and its token, ordered by pair_before: larger value first, then lower index, a total
// order (no NaN reaches here), so every selection and sort below gives one answer.
typedef struct {
    float v;
    int32_t i;
} Pair;

static int pair_before(Pair a, Pair b) {
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

static int pair_cmp(const void *pa, const void *pb) {
    Pair a = *(const Pair *)pa, b = *(const Pair *)pb;
    return pair_before(a, b) ? -1 : pair_before(b, a) ? 1 : 0;
}

static void pair_swap(Pair *p, int a, int b) {
    Pair t = p[a];
    p[a] = p[b];
    p[b] = t;
}

// Hoare's partition of p[lo..hi] (lo < hi) around the median of three: afterwards p[lo..*jo]
// come before the pivot or are it, p[*io..hi] come after it or are it, and p(*jo, *io), when
// not empty, is the pivot. So every pair of the first part comes before every pair of the last.
static void partition(Pair *p, int lo, int hi, int *jo, int *io) {
    int mid = lo + (hi - lo) / 2;
    if (pair_before(p[mid], p[lo])) pair_swap(p, mid, lo);
    if (pair_before(p[hi], p[lo])) pair_swap(p, hi, lo);
    if (pair_before(p[hi], p[mid])) pair_swap(p, hi, mid);
    Pair pivot = p[mid];
    int i = lo, j = hi;
    while (i <= j) {
        while (pair_before(p[i], pivot))
            i++;
        while (pair_before(pivot, p[j]))
            j--;
        if (i <= j) pair_swap(p, i++, j--);
    }
    *jo = j;
    *io = i;
}

// Rearranges p (n) so that p[0..k) are its first k pairs in pair_before order, unordered
// (Hoare's selection; 1 <= k <= n).
static void select_first(Pair *p, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        int j, i;
        partition(p, lo, hi, &j, &i);
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return;
    }
}

// ---------------------------------------------------------------- checks

int sample_options_check(const SampleOptions *o, Err *err) {
    if (!(o->temperature >= 0.0f) || isinf(o->temperature))
        return err_set(err, "temperature %g: must be a finite number >= 0 (0: greedy)",
                       (double)o->temperature);
    if (o->top_k < 0) return err_set(err, "top_k %d: must be >= 0 (0: off)", o->top_k);
    if (!(o->top_p > 0.0f && o->top_p <= 1.0f))
        return err_set(err, "top_p %g: must be in (0, 1] (1: off)", (double)o->top_p);
    if (!isfinite(o->frequency_penalty))
        return err_set(err, "frequency_penalty %g: must be a finite number (0: off)",
                       (double)o->frequency_penalty);
    if (o->rep_window < 0) return err_set(err, "rep_window %d: must be >= 0", o->rep_window);
    return 0;
}

// Checks logits (V) for values softmax cannot take and finds the argmax (the first maximum, as
// torch.argmax). -inf is a token the model rules out; NaN and +inf are errors.
static int scan_logits(const float *logits, int V, int32_t *argmax, Err *err) {
    if (V < 1) return err_set(err, "vocabulary size %d: must be >= 1", V);
    int32_t best = -1;
    for (int i = 0; i < V; i++) {
        float x = logits[i];
        if (isnan(x) || x == INFINITY)
            return err_set(err, "logits[%d] = %g: must be a number < +inf", i, (double)x);
        if (x != -INFINITY && (best < 0 || x > logits[best])) best = i;
    }
    if (best < 0) return err_set(err, "logits: all %d are -inf, no token to sample", V);
    *argmax = best;
    return 0;
}

static int check_tokens(const char *what, const int32_t *ids, int n, int V, Err *err) {
    if (n < 0) return err_set(err, "history: %s count %d is negative", what, n);
    if (n > 0 && !ids) return err_set(err, "history: %d %s tokens but no array", n, what);
    for (int j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= V)
            return err_set(err, "history: %s[%d] = %d outside the vocabulary [0, %d)", what, j,
                           ids[j], V);
    return 0;
}

static int check_history(const SampleHistory *h, int V, Err *err) {
    if (!h) return 0;
    if (check_tokens("prompt", h->prompt, h->n_prompt, V, err)) return -1;
    return check_tokens("output", h->output, h->n_output, V, err);
}

// ---------------------------------------------------------------- the strategies

// w = logits / max(t, 1e-8) (sample.py:63-71: the same clamp); t == 1 copies.
static int apply_temperature(float t, const float *logits, int V, float *w, Err *err) {
    float d = fmaxf(t, 1e-8f);
    for (int i = 0; i < V; i++) {
        w[i] = t == 1.0f ? logits[i] : logits[i] / d;
        if (w[i] == INFINITY)
            return err_set(err, "logits[%d] = %g over temperature %g overflows", i,
                           (double)logits[i], (double)t);
    }
    return 0;
}

// Removes every w below the k-th largest (sample.py:111-112: `logits < threshold`), so ties
// with the k-th all stay. 1 <= k < V.
static void apply_top_k(float *w, int V, int k, Pair *pairs) {
    for (int i = 0; i < V; i++)
        pairs[i] = (Pair){w[i], i};
    select_first(pairs, V, k);
    float thr = pairs[0].v; // the k-th value: the smallest of the first k
    for (int j = 1; j < k; j++)
        thr = fminf(thr, pairs[j].v);
    for (int i = 0; i < V; i++)
        if (w[i] < thr) w[i] = -INFINITY;
}

// The sum of exp(v - M) over n pairs.
static double mass(const Pair *p, int n, double M) {
    double sum = 0.0;
    for (int j = 0; j < n; j++)
        sum += exp((double)p[j].v - M);
    return sum;
}

// The length n of the nucleus of pairs (m, the finite logits, max M): the shortest prefix in
// pair_before order whose mass, sum exp(v - M), exceeds P = p * Z (all m when none does),
// gathered into pairs[0..n), unordered. A selection by mass: each round partitions the range
// the prefix ends in and sums the part before the pivot to see which side it ends on, O(m)
// expected, where sorting the nucleus of a flat distribution would cost O(m log m). The last
// few pairs are sorted and walked.
static int nucleus(Pair *pairs, int m, double M, double P) {
    int lo = 0, hi = m; // the prefix ends in [lo, hi); acc is the mass of pairs[0..lo)
    double acc = 0.0;
    while (hi - lo > 16) {
        int j, i;
        partition(pairs, lo, hi - 1, &j, &i);
        double first = mass(pairs + lo, j + 1 - lo, M);
        if (acc + first > P) { // it ends in the first part
            hi = j + 1;
            continue;
        }
        acc += first;
        if (j + 1 < i && (acc += exp((double)pairs[j + 1].v - M)) > P) return j + 2; // the pivot
        lo = i;
    }
    qsort(pairs + lo, (size_t)(hi - lo), sizeof(Pair), pair_cmp);
    for (int r = lo; r < hi; r++)
        if ((acc += exp((double)pairs[r].v - M)) > P) return r + 1; // sample.py:132-134
    return hi; // all of them; or [lo, hi) whose sum, in another order, rounded past P
}

// Keeps the nucleus of softmax(w) (sample.py:130-137); the rest become -inf.
static void apply_top_p(float *w, int V, float p, Pair *pairs) {
    int m = 0;
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (w[i] != -INFINITY) {
            pairs[m++] = (Pair){w[i], i};
            mx = fmaxf(mx, w[i]);
        }
    int keep = nucleus(pairs, m, mx, p * mass(pairs, m, mx));
    for (int j = keep; j < m; j++)
        w[pairs[j].i] = -INFINITY;
}

// The two runs of tokens the penalty counts (executor.py:110-111): the prompt's last
// rep_window, then the whole output.
typedef struct {
    const int32_t *ids;
    int n;
} Span;

static void counted_spans(const SampleHistory *h, int window, Span run[2]) {
    int from = h->n_prompt - (window < h->n_prompt ? window : h->n_prompt);
    run[0] = (Span){from < h->n_prompt ? h->prompt + from : NULL, h->n_prompt - from};
    run[1] = (Span){h->output, h->n_output};
}

// w[t] -= f * count(t) on the surviving tokens (sample.py:215-232: counts as floats, one
// multiply and one subtraction per token, not one per occurrence). counts (V) is scratch: only
// the entries of counted tokens are touched, zeroed first, so it needs no initialisation.
static int apply_penalty(float *w, float f, int window, const SampleHistory *h, int32_t *counts,
                         Err *err) {
    Span run[2];
    counted_spans(h, window, run);
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < run[r].n; j++)
            counts[run[r].ids[j]] = 0;
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < run[r].n; j++)
            counts[run[r].ids[j]]++;
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < run[r].n; j++) {
            int32_t t = run[r].ids[j];
            if (counts[t] > 0 && w[t] != -INFINITY) { // a removed token stays removed
                w[t] -= f * (float)counts[t];
                if (w[t] == INFINITY)
                    return err_set(err,
                                   "frequency_penalty %g: token %d's penalised logit "
                                   "overflows",
                                   (double)f, t);
            }
            counts[t] = 0; // its later occurrences: already applied
        }
    return 0;
}

// The largest finite w, or -inf when every token was removed.
static float max_finite(const float *w, int V) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        mx = fmaxf(mx, w[i]);
    return mx;
}

// Steps 1-4 of sample.h on checked input, into w (V; may be logits).
static int transform_checked(const SampleOptions *o, const float *logits, int V,
                             const SampleHistory *h, void *scratch, float *w, Err *err) {
    Pair *pairs = scratch;
    int32_t *counts = (int32_t *)(pairs + V);
    if (apply_temperature(o->temperature, logits, V, w, err)) return -1;
    if (o->top_k > 0 && o->top_k < V) apply_top_k(w, V, o->top_k, pairs);
    if (o->top_p < 1.0f) apply_top_p(w, V, o->top_p, pairs);
    if (o->frequency_penalty != 0.0f && h &&
        apply_penalty(w, o->frequency_penalty, o->rep_window, h, counts, err))
        return -1;
    if (max_finite(w, V) == -INFINITY)
        return err_set(err, "frequency_penalty %g: every token's penalised logit is -inf",
                       (double)o->frequency_penalty);
    return 0;
}

// Checks everything sample_transform and sample_token take; the argmax comes back.
static int check_input(const SampleOptions *o, const float *logits, int V, const SampleHistory *h,
                       int32_t *argmax, Err *err) {
    if (sample_options_check(o, err) || scan_logits(logits, V, argmax, err)) return -1;
    return check_history(h, V, err);
}

// ---------------------------------------------------------------- the API

size_t sample_scratch_bytes(int V) {
    // pairs (8 V) for the selections, counts (4 V) for the penalty, the logits (4 V) that
    // sample_token transforms
    return V > 0 ? (size_t)V * (sizeof(Pair) + sizeof(int32_t) + sizeof(float)) : 0;
}

int sample_transform(const SampleOptions *o, const float *logits, int V, const SampleHistory *h,
                     void *scratch, float *out, Err *err) {
    int32_t argmax = 0;
    if (check_input(o, logits, V, h, &argmax, err)) return -1;
    if (o->temperature == 0.0f) {
        for (int i = 0; i < V; i++)
            out[i] = i == argmax ? 0.0f : -INFINITY;
        return 0;
    }
    return transform_checked(o, logits, V, h, scratch, out, err);
}

// The inverse CDF of softmax(w) at u, walked in token-index order with the same sum as its
// normaliser, so a token of probability 0 (removed, or underflowing) is never drawn.
static int32_t draw(const float *w, int V, double u, double M, double Z) {
    double target = u * Z, cum = 0.0;
    int32_t last = -1;
    for (int i = 0; i < V; i++) {
        if (w[i] == -INFINITY) continue;
        double e = exp((double)w[i] - M);
        if (e == 0.0) continue;
        cum += e;
        last = i;
        if (cum > target) return i;
    }
    return last; // u * Z rounded up to Z: the last token of nonzero probability
}

int sample_token(const SampleOptions *o, const float *logits, int V, const SampleHistory *h,
                 uint64_t sequence, uint64_t position, void *scratch, int32_t *token,
                 float *logprob, Err *err) {
    int32_t argmax = 0;
    if (check_input(o, logits, V, h, &argmax, err)) return -1;
    if (o->temperature == 0.0f) { // greedy: the point mass on the argmax
        *token = argmax;
        *logprob = 0.0f;
        return 0;
    }
    float *w = (float *)((char *)scratch + (size_t)V * (sizeof(Pair) + sizeof(int32_t)));
    if (transform_checked(o, logits, V, h, scratch, w, err)) return -1;
    double M = max_finite(w, V), Z = 0.0;
    for (int i = 0; i < V; i++)
        if (w[i] != -INFINITY) Z += exp((double)w[i] - M);
    *token = draw(w, V, sample_uniform(o->seed, sequence, position), M, Z);
    *logprob = (float)(((double)w[*token] - M) - log(Z));
    return 0;
}

int sample_model_logprob(const float *logits, int V, int32_t token, float *logprob, Err *err) {
    int32_t argmax = 0;
    if (scan_logits(logits, V, &argmax, err)) return -1;
    if (token < 0 || token >= V)
        return err_set(err, "token %d outside the vocabulary [0, %d)", token, V);
    double M = logits[argmax], Z = 0.0;
    for (int i = 0; i < V; i++)
        if (logits[i] != -INFINITY) Z += exp((double)logits[i] - M);
    *logprob = (float)(((double)logits[token] - M) - log(Z));
    return 0;
}
