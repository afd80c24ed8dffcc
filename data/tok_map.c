// tok_map.c: the tokenizer's hash maps (tok_internal.h): byte strings -> ids, id pairs -> merges.
#include <stdlib.h>
#include <string.h>

#include "data/tok_internal.h"

static uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    for (; n >= 8; s += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
        h ^= h >> 29;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    return mix(h ^ w);
}

// The slot of key: where it is, or the empty slot where it would go.
static size_t find_slot(const StrMap *m, const char *key, size_t len) {
    size_t mask = m->cap - 1;
    for (size_t i = hash_bytes(key, len) & mask;; i = (i + 1) & mask) {
        uint32_t e = m->slots[i];
        if (e == 0) return i;
        const StrEntry *x = &m->entries[e - 1];
        if (x->len == len && memcmp(m->keys.data + x->off, key, len) == 0) return i;
    }
}

static int strmap_grow(StrMap *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return -1;
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    for (size_t e = 0; e < m->n; e++) {
        const StrEntry *x = &m->entries[e];
        m->slots[find_slot(m, m->keys.data + x->off, x->len)] = (uint32_t)e + 1;
    }
    return 0;
}

int strmap_put(StrMap *m, const char *key, size_t len, int32_t val) {
    if (len > UINT32_MAX || m->n >= UINT32_MAX - 1) return -1;
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) != 0) return -1;
    size_t i = find_slot(m, key, len);
    if (m->slots[i]) {
        m->entries[m->slots[i] - 1].val = val;
        return 0;
    }
    if (buf_reserve(&m->entries, &m->entries_cap, m->n + 1, sizeof *m->entries) != 0) return -1;
    size_t off = m->keys.len;
    if (buf_append(&m->keys, key, len) != 0) return -1;
    m->entries[m->n] = (StrEntry){off, (uint32_t)len, val};
    m->slots[i] = (uint32_t)++m->n;
    return 0;
}

int32_t strmap_get(const StrMap *m, const char *key, size_t len) {
    if (!m->cap) return -1;
    uint32_t e = m->slots[find_slot(m, key, len)];
    return e ? m->entries[e - 1].val : -1;
}

void strmap_clear(StrMap *m) {
    if (m->cap) memset(m->slots, 0, m->cap * sizeof *m->slots);
    m->n = 0;
    m->keys.len = 0;
}

void strmap_free(StrMap *m) {
    free(m->slots);
    free(m->entries);
    buf_free(&m->keys);
    *m = (StrMap){0};
}

static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
}

static size_t pair_slot(const PairMap *m, uint64_t key) {
    size_t mask = m->cap - 1;
    for (size_t i = mix(key) & mask;; i = (i + 1) & mask)
        if (m->keys[i] == key || m->keys[i] == UINT64_MAX) return i;
}

static int pairmap_grow(PairMap *m) {
    PairMap g = {.cap = m->cap ? m->cap * 2 : 1024, .n = m->n};
    g.keys = malloc(g.cap * sizeof *g.keys);
    g.rank = malloc(g.cap * sizeof *g.rank);
    g.new_id = malloc(g.cap * sizeof *g.new_id);
    if (!g.keys || !g.rank || !g.new_id) {
        pairmap_free(&g);
        return -1;
    }
    memset(g.keys, 0xff, g.cap * sizeof *g.keys);
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == UINT64_MAX) continue;
        size_t j = pair_slot(&g, m->keys[i]);
        g.keys[j] = m->keys[i];
        g.rank[j] = m->rank[i];
        g.new_id[j] = m->new_id[i];
    }
    pairmap_free(m);
    *m = g;
    return 0;
}

int pairmap_put(PairMap *m, int32_t a, int32_t b, uint32_t rank, int32_t new_id) {
    if ((m->n + 1) * 2 > m->cap && pairmap_grow(m) != 0) return -1;
    uint64_t key = pair_key(a, b);
    size_t i = pair_slot(m, key);
    if (m->keys[i] == UINT64_MAX) m->n++;
    m->keys[i] = key;
    m->rank[i] = rank;
    m->new_id[i] = new_id;
    return 0;
}

int pairmap_get(const PairMap *m, int32_t a, int32_t b, uint32_t *rank, int32_t *new_id) {
    if (!m->cap) return 0;
    size_t i = pair_slot(m, pair_key(a, b));
    if (m->keys[i] == UINT64_MAX) return 0;
    *rank = m->rank[i];
    *new_id = m->new_id[i];
    return 1;
}

void pairmap_free(PairMap *m) {
    free(m->keys);
    free(m->rank);
    free(m->new_id);
    *m = (PairMap){0};
}
