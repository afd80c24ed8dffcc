// expert_group.c: the plan of an expert-parallel exchange (engine/expert_group.h).
#include "engine/expert_group.h"

void expert_rows_to(const ExpertGroup *g, int E, const int32_t *pairs, size_t *rows) {
    int El = E / g->size;
    for (int q = 0; q < g->size; q++) {
        rows[q] = 0;
        for (int j = 0; j < El; j++)
            rows[q] += (size_t)pairs[q * El + j];
    }
}

size_t expert_rows_from(const ExpertGroup *g, int El, const int32_t *from, size_t *rows) {
    size_t total = 0;
    for (int s = 0; s < g->size; s++) {
        rows[s] = 0;
        for (int j = 0; j < El; j++)
            rows[s] += (size_t)from[s * El + j];
        total += rows[s];
    }
    return total;
}

// Expert j's rows, sender by sender: the received block of (s, j) starts where the rows of
// senders before s and of s's experts before j end.
void expert_order(const ExpertGroup *g, int El, const int32_t *from, int32_t *order,
                  int32_t *inverse, int32_t *per_expert) {
    int32_t i = 0;
    for (int j = 0; j < El; j++) {
        per_expert[j] = 0;
        int32_t block = 0; // received row where (s, j) starts
        for (int s = 0; s < g->size; s++) {
            int32_t at = block;
            for (int jj = 0; jj < j; jj++)
                at += from[s * El + jj];
            for (int32_t r = 0; r < from[s * El + j]; r++, i++) {
                order[i] = at + r;
                inverse[at + r] = i;
            }
            per_expert[j] += from[s * El + j];
            for (int jj = 0; jj < El; jj++)
                block += from[s * El + jj];
        }
    }
}
