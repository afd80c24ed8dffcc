// expert_group.h: expert parallelism (docs/design.md §7a). The routed experts of every MoE layer
// are split over the `size` ranks of an expert group: with El = E / size, rank q computes experts
// [q*El, (q+1)*El) for the (token, choice) pairs of every rank of the group. A layer's forward
// sends each rank's pairs (grouped by expert, in expert order: moe_route) to their experts' ranks
// and the experts' outputs back; its backward moves their gradients the same two ways. The
// functions below are the host-side plan of one such exchange; the transfer is the group's
// all_to_all (comm_all_to_all's contract: backend memory, rank q's part at send_bytes[0..q)).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct {
    int size, rank; // 0 or 1: no expert parallelism (every expert on every rank)
    int (*all_to_all)(void *ctx, const void *send, const size_t *send_bytes, void *recv,
                      const size_t *recv_bytes, Err *err);
    void *ctx;
} ExpertGroup;

// Rows this rank sends to each rank q of the group: its pairs of q's experts. pairs: (E) this
// rank's pairs per expert; rows: (size).
void expert_rows_to(const ExpertGroup *g, int E, const int32_t *pairs, size_t *rows);
// Rows this rank receives from each rank s, and in all: from: (size, El) the pairs rank s sends
// for each of this rank's experts; rows: (size).
size_t expert_rows_from(const ExpertGroup *g, int El, const int32_t *from, size_t *rows);
// The received rows (rank by rank, each rank's grouped by expert) put in expert order: row i of
// the experts' groups is received row order[i]; inverse[order[i]] = i; per_expert: (El) the rows
// of each of this rank's experts. order, inverse: (the rows received).
void expert_order(const ExpertGroup *g, int El, const int32_t *from, int32_t *order,
                  int32_t *inverse, int32_t *per_expert);
