// topk.h: torch.topk(vals, k) (largest=True, sorted=True) on the CPU, reproduced exactly,
// ties and NaNs included, so that a mixture-of-experts router in C (engine/cpu/) and in CUDA
// device code (engine/cuda/) picks the same experts, in the same order, as PyTorch.
//
// Shapes: vals (E) floats; scratch (E) TopkPair; idx (k) out; 1 <= k <= E.
//
// torch's CPU kernel (aten/src/ATen/native/TopKImpl.h, topk_impl_loop) fills a vector of
// (value, index) pairs in index order and, with comp(x, y) = (isnan(x) && !isnan(y)) || x > y
// (NaN first, then descending):
//   - k * 64 <= E: std::partial_sort(begin, begin + k, end, comp);
//   - otherwise:   std::nth_element(begin, begin + k - 1, end, comp), then
//                  std::sort(begin, begin + k - 1, comp) (only the first k - 1: the k-th is
//                  already in place after nth_element).
// Neither algorithm is stable, so which of several equal values wins, and their order, is
// decided by the element moves of libstdc++'s implementation (GCC 12, Debian 12's torch).
// Every routine below is a port of the libstdc++ routine of the same name (bits/stl_algo.h,
// bits/stl_heap.h), with iterators as offsets and the same comparisons in the same argument
// order. torch holds the values as double (acc_type<float>); a float widened to double keeps
// its order and NaN-ness, so comparing the floats gives the same answers.
//
// Header-only, no libc, no recursion (__introsort_loop's recursion is an explicit stack of at
// most 2*floor(log2(E)) entries, visited in the recursion's order): it compiles as C11 and as
// CUDA __host__ __device__ code.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define TOPK_FN __host__ __device__ static inline
#else
#define TOPK_FN static inline
#endif

typedef struct {
    float value;
    int32_t index;
} TopkPair;

// libstdc++'s _S_threshold: introsort leaves ranges of up to 16 to the final insertion sort.
#define TOPK_SORT_THRESHOLD 16
// 2 * floor(log2(INT_MAX)) + slack: the deepest introsort stack any int length can need.
#define TOPK_STACK_MAX 64

// x != x rather than isnan(): no <math.h>, and the same test on the host and the device (it
// needs IEEE comparisons: no -ffast-math / -ffinite-math-only on a file that includes this).
TOPK_FN int topk_isnan(float x) {
    return x != x;
}

// torch's comparator for largest=True: NaN before every number, then larger before smaller.
TOPK_FN int topk_comp(TopkPair x, TopkPair y) {
    return (topk_isnan(x.value) && !topk_isnan(y.value)) || (x.value > y.value);
}

// std::__lg: floor(log2(n)) for n >= 1.
TOPK_FN int topk_lg(int n) {
    int lg = 0;
    while (n >>= 1)
        lg++;
    return lg;
}

TOPK_FN void topk_iter_swap(TopkPair *a, TopkPair *b) {
    TopkPair t = *a;
    *a = *b;
    *b = t;
}

// ---------------------------------------------------------------- heap (bits/stl_heap.h)

// __push_heap: moves `value` up from hole towards top while its parent compares below it.
TOPK_FN void topk_push_heap(TopkPair *first, int hole, int top, TopkPair value) {
    int parent = (hole - 1) / 2;
    while (hole > top && topk_comp(first[parent], value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

// __adjust_heap: sinks the hole to a leaf along the larger children, then pushes `value` back
// up from there (Floyd's trick; the reason equal keys end up where they do).
TOPK_FN void topk_adjust_heap(TopkPair *first, int hole, int len, TopkPair value) {
    const int top = hole;
    int child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (topk_comp(first[child], first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    topk_push_heap(first, hole, top, value);
}

// __pop_heap: the top goes to *result, *result's old value is sifted into [first, last).
TOPK_FN void topk_pop_heap(TopkPair *first, TopkPair *last, TopkPair *result) {
    TopkPair value = *result;
    *result = *first;
    topk_adjust_heap(first, 0, (int)(last - first), value);
}

TOPK_FN void topk_make_heap(TopkPair *first, TopkPair *last) {
    const int len = (int)(last - first);
    if (len < 2) return;
    for (int parent = (len - 2) / 2;; parent--) {
        topk_adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

TOPK_FN void topk_sort_heap(TopkPair *first, TopkPair *last) {
    while (last - first > 1) {
        --last;
        topk_pop_heap(first, last, last);
    }
}

// ---------------------------------------------------------------- sorting (bits/stl_algo.h)

// __heap_select: [first, middle) becomes a heap of the (middle - first) comp-smallest.
TOPK_FN void topk_heap_select(TopkPair *first, TopkPair *middle, TopkPair *last) {
    topk_make_heap(first, middle);
    for (TopkPair *i = middle; i < last; ++i)
        if (topk_comp(*i, *first)) topk_pop_heap(first, middle, i);
}

// __partial_sort, which std::partial_sort calls directly.
TOPK_FN void topk_partial_sort(TopkPair *first, TopkPair *middle, TopkPair *last) {
    topk_heap_select(first, middle, last);
    topk_sort_heap(first, middle);
}

// __unguarded_linear_insert: no bound check, a smaller-or-equal element sits to the left.
TOPK_FN void topk_unguarded_linear_insert(TopkPair *last) {
    TopkPair val = *last;
    TopkPair *next = last - 1;
    while (topk_comp(val, *next)) {
        *last = *next;
        last = next;
        --next;
    }
    *last = val;
}

TOPK_FN void topk_insertion_sort(TopkPair *first, TopkPair *last) {
    if (first == last) return;
    for (TopkPair *i = first + 1; i != last; ++i) {
        if (topk_comp(*i, *first)) {
            // move_backward(first, i, i + 1), then the new minimum goes to the front.
            TopkPair val = *i;
            for (TopkPair *p = i; p != first; --p)
                *p = *(p - 1);
            *first = val;
        } else {
            topk_unguarded_linear_insert(i);
        }
    }
}

TOPK_FN void topk_unguarded_insertion_sort(TopkPair *first, TopkPair *last) {
    for (TopkPair *i = first; i != last; ++i)
        topk_unguarded_linear_insert(i);
}

// __final_insertion_sort: after introsort every element is within 16 of its place and the
// first 16 hold the minimum, so past them the insertion may run unguarded.
TOPK_FN void topk_final_insertion_sort(TopkPair *first, TopkPair *last) {
    if (last - first > TOPK_SORT_THRESHOLD) {
        topk_insertion_sort(first, first + TOPK_SORT_THRESHOLD);
        topk_unguarded_insertion_sort(first + TOPK_SORT_THRESHOLD, last);
    } else {
        topk_insertion_sort(first, last);
    }
}

// __move_median_to_first: swaps the median of *a, *b, *c into *result.
TOPK_FN void topk_move_median_to_first(TopkPair *result, TopkPair *a, TopkPair *b, TopkPair *c) {
    if (topk_comp(*a, *b)) {
        if (topk_comp(*b, *c))
            topk_iter_swap(result, b);
        else if (topk_comp(*a, *c))
            topk_iter_swap(result, c);
        else
            topk_iter_swap(result, a);
    } else if (topk_comp(*a, *c)) {
        topk_iter_swap(result, a);
    } else if (topk_comp(*b, *c)) {
        topk_iter_swap(result, c);
    } else {
        topk_iter_swap(result, b);
    }
}

// __unguarded_partition: Hoare partition around *pivot (which lies outside [first, last)).
TOPK_FN TopkPair *topk_unguarded_partition(TopkPair *first, TopkPair *last, TopkPair *pivot) {
    for (;;) {
        while (topk_comp(*first, *pivot))
            ++first;
        --last;
        while (topk_comp(*pivot, *last))
            --last;
        if (!(first < last)) return first;
        topk_iter_swap(first, last);
        ++first;
    }
}

// __unguarded_partition_pivot: median of (first + 1, mid, last - 1) as pivot, kept at *first.
TOPK_FN TopkPair *topk_unguarded_partition_pivot(TopkPair *first, TopkPair *last) {
    TopkPair *mid = first + (last - first) / 2;
    topk_move_median_to_first(first, first + 1, mid, last - 1);
    return topk_unguarded_partition(first + 1, last, first);
}

// __introsort_loop. libstdc++ recurses into [cut, last) and loops on [first, cut), both with
// the decremented depth; here the left part waits on a stack (as offsets from `base`, to keep
// a device thread's frame small) while the right one is done, the same visiting order. Pushed
// depths strictly decrease from bottom to top, so the stack never holds more entries than the
// initial depth limit (<= 60 for an int length).
TOPK_FN void topk_introsort_loop(TopkPair *first, TopkPair *last, int depth_limit) {
    TopkPair *const base = first;
    int32_t pending_first[TOPK_STACK_MAX], pending_last[TOPK_STACK_MAX];
    int8_t pending_depth[TOPK_STACK_MAX];
    int top = 0;
    for (;;) {
        while (last - first > TOPK_SORT_THRESHOLD) {
            if (depth_limit == 0) {
                topk_partial_sort(first, last, last);
                break;
            }
            --depth_limit;
            TopkPair *cut = topk_unguarded_partition_pivot(first, last);
            pending_first[top] = (int32_t)(first - base);
            pending_last[top] = (int32_t)(cut - base);
            pending_depth[top] = (int8_t)depth_limit;
            top++;
            first = cut;
        }
        if (top == 0) return;
        top--;
        first = base + pending_first[top];
        last = base + pending_last[top];
        depth_limit = pending_depth[top];
    }
}

// std::sort = __sort.
TOPK_FN void topk_sort(TopkPair *first, TopkPair *last) {
    if (first == last) return;
    topk_introsort_loop(first, last, topk_lg((int)(last - first)) * 2);
    topk_final_insertion_sort(first, last);
}

// __introselect: quickselect on the side holding nth; heap_select once the depth runs out,
// insertion sort once at most 3 elements are left.
TOPK_FN void topk_introselect(TopkPair *first, TopkPair *nth, TopkPair *last, int depth_limit) {
    while (last - first > 3) {
        if (depth_limit == 0) {
            topk_heap_select(first, nth + 1, last);
            // The heap's top is the (nth - first + 1)-th smallest: it goes to nth.
            topk_iter_swap(first, nth);
            return;
        }
        --depth_limit;
        TopkPair *cut = topk_unguarded_partition_pivot(first, last);
        if (cut <= nth)
            first = cut;
        else
            last = cut;
    }
    topk_insertion_sort(first, last);
}

// std::nth_element.
TOPK_FN void topk_nth_element(TopkPair *first, TopkPair *nth, TopkPair *last) {
    if (first == last || nth == last) return;
    topk_introselect(first, nth, last, topk_lg((int)(last - first)) * 2);
}

// torch.topk's selection by one of its two paths: partial_sort (partial != 0), or nth_element then
// a sort of the first k-1. idx: (k) the chosen indices in order; scratch: (E) pairs. 1 <= k <= E.
TOPK_FN void topk_select_path(const float *vals, int E, int k, int partial, TopkPair *scratch,
                              int32_t *idx) {
    for (int j = 0; j < E; j++) {
        scratch[j].value = vals[j];
        scratch[j].index = j;
    }
    if (partial) {
        topk_partial_sort(scratch, scratch + k, scratch + E);
    } else {
        topk_nth_element(scratch, scratch + k - 1, scratch + E);
        topk_sort(scratch, scratch + k - 1);
    }
    for (int j = 0; j < k; j++)
        idx[j] = scratch[j].index;
}

// idx: (k) the indices torch.topk(vals, k) returns, in its order; scratch: (E) pairs. 1 <= k <= E.
// torch: use_partial_sort = k * 64 <= dim_size (in int64, so no overflow here either).
TOPK_FN void topk_torch_cpu(const float *vals, int E, int k, TopkPair *scratch, int32_t *idx) {
    topk_select_path(vals, E, k, (int64_t)k * 64 <= (int64_t)E, scratch, idx);
}

// idx[0..k) sorted ascending in place (an insertion sort: k is small): a token's chosen experts
// listed by index, the order their outputs are combined in (AstrAI's index_add_ over experts).
TOPK_FN void topk_by_index(int32_t *idx, int k) {
    for (int j = 1; j < k; j++)
        for (int i = j; i > 0 && idx[i - 1] > idx[i]; i--) {
            int32_t t = idx[i];
            idx[i] = idx[i - 1];
            idx[i - 1] = t;
        }
}
