// hf.c: the weights of a Hugging Face conversion (ckpt/hf.h): which source tensor each output
// tensor is, checked before anything is written, then streamed from the mmap'd source into
// safetensors files one tensor at a time, rows permuted where RoPE layouts differ.
#include "ckpt/hf.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ckpt/shards.h"
#include "common/fsutil.h"
#include "common/half.h"
#include "common/json.h"
#include "common/path.h"

// One output tensor: its name, the source tensor's, the shape both have (in config terms for
// messages), and whether its rows are heads of head_dim rows in the other RoPE layout.
typedef struct {
    char src[128], dst[128];
    const char *dims;
    int ndim;
    int64_t shape[2];
    bool rope;
    const StTensor *t; // the source tensor
    DType out;         // the output dtype
    int shard;         // the output file (hf_plan_shards)
} HfEntry;

struct HfConversion {
    StFile src;
    char src_path[PATH_MAX]; // what shards_open opened: the file or the index
    bool import;             // HF -> AstrAI: halves to pairs; else pairs to halves
    int head_dim;
    HfEntry *entries;
    int n, n_shards;
    int cap; // entries allocated: plan_add drops what would exceed it
    cJSON *config;
};

// ---------------------------------------------------------------- the plan

static void plan_add(HfConversion *c, const char *astrai, const char *hf, const char *dims,
                     int64_t rows, int64_t cols, bool rope) {
    if (c->n == c->cap) return;
    HfEntry *e = &c->entries[c->n++];
    *e = (HfEntry){.ndim = cols ? 2 : 1, .shape = {rows, cols}, .rope = rope, .dims = dims};
    snprintf(c->import ? e->src : e->dst, sizeof e->src, "%s", hf);
    snprintf(c->import ? e->dst : e->src, sizeof e->dst, "%s", astrai);
}

// Mixtral's feed-forward of block i as DeepSeekMoE's without shared experts (docs/design.md
// §7a): the router is block_sparse_moe.gate, expert e's w1, w3, w2 its gate, up and down. The
// shapes are named in the source's config terms (num_local_experts or n_routed_experts).
static void plan_experts(HfConversion *c, const HfShape *s, int i) {
    const int64_t H = s->hidden_size, I = s->intermediate_size, E = s->n_routed_experts;
    char astrai[128], hf[128];
    snprintf(astrai, sizeof astrai, "layers.%d.mlp.router.weight", i);
    snprintf(hf, sizeof hf, "model.layers.%d.block_sparse_moe.gate.weight", i);
    plan_add(c, astrai, hf,
             c->import ? "(num_local_experts, hidden_size)" : "(n_routed_experts, hidden_size)", E,
             H, false);
    const struct {
        const char *astrai, *hf, *dims;
        int64_t rows, cols;
    } T[] = {
        {"up", "w3", "(intermediate_size, hidden_size)", I, H},
        {"gate", "w1", "(intermediate_size, hidden_size)", I, H},
        {"down", "w2", "(hidden_size, intermediate_size)", H, I},
    };
    for (int64_t e = 0; e < E && c->n < c->cap; e++)
        for (size_t k = 0; k < sizeof T / sizeof *T; k++) {
            snprintf(astrai, sizeof astrai, "layers.%d.mlp.routed_experts.%d.%s.weight", i, (int)e,
                     T[k].astrai);
            snprintf(hf, sizeof hf, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", i,
                     (int)e, T[k].hf);
            plan_add(c, astrai, hf, T[k].dims, T[k].rows, T[k].cols, false);
        }
}

// The tensors of block i (docs/design.md §7's names; HF's model.layers.{i}.*).
static void plan_block(HfConversion *c, const HfShape *s, int i) {
    const int64_t H = s->hidden_size, Q = (int64_t)s->num_attention_heads * s->head_dim,
                  KV = (int64_t)s->num_key_value_heads * s->head_dim, I = s->intermediate_size;
    const bool moe = s->n_routed_experts > 0;
    const struct {
        const char *astrai, *hf, *dims;
        int64_t rows, cols;
        bool rope, when;
    } T[] = {
        {"attention.q_proj.weight", "self_attn.q_proj.weight",
         "(num_attention_heads*head_dim, hidden_size)", Q, H, true, true},
        {"attention.k_proj.weight", "self_attn.k_proj.weight",
         "(num_key_value_heads*head_dim, hidden_size)", KV, H, true, true},
        {"attention.v_proj.weight", "self_attn.v_proj.weight",
         "(num_key_value_heads*head_dim, hidden_size)", KV, H, false, true},
        {"attention.o_proj.weight", "self_attn.o_proj.weight",
         "(hidden_size, num_attention_heads*head_dim)", H, Q, false, true},
        {"attention.o_proj.bias", "self_attn.o_proj.bias", "(hidden_size)", H, 0, false,
         s->o_proj_bias},
        {"attention.q_proj.bias", "self_attn.q_proj.bias", "(num_attention_heads*head_dim)", Q, 0,
         true, s->attention_bias},
        {"attention.k_proj.bias", "self_attn.k_proj.bias", "(num_key_value_heads*head_dim)", KV, 0,
         true, s->attention_bias},
        {"attention.v_proj.bias", "self_attn.v_proj.bias", "(num_key_value_heads*head_dim)", KV, 0,
         false, s->attention_bias},
        {"attention.q_norm.weight", "self_attn.q_norm.weight", "(head_dim)", s->head_dim, 0, true,
         s->qk_norm},
        {"attention.k_norm.weight", "self_attn.k_norm.weight", "(head_dim)", s->head_dim, 0, true,
         s->qk_norm},
        {"input_norm.weight", "input_layernorm.weight", "(hidden_size)", H, 0, false, true},
        {"post_attention_norm.weight", "post_attention_layernorm.weight", "(hidden_size)", H, 0,
         false, true},
        {"mlp.up.weight", "mlp.up_proj.weight", "(intermediate_size, hidden_size)", I, H, false,
         !moe},
        {"mlp.gate.weight", "mlp.gate_proj.weight", "(intermediate_size, hidden_size)", I, H, false,
         !moe},
        {"mlp.down.weight", "mlp.down_proj.weight", "(hidden_size, intermediate_size)", H, I, false,
         !moe},
    };
    for (size_t k = 0; k < sizeof T / sizeof *T; k++) {
        if (!T[k].when) continue;
        char astrai[128], hf[128];
        snprintf(astrai, sizeof astrai, "layers.%d.%s", i, T[k].astrai);
        snprintf(hf, sizeof hf, "model.layers.%d.%s", i, T[k].hf);
        plan_add(c, astrai, hf, T[k].dims, T[k].rows, T[k].cols, T[k].rope);
    }
    if (moe) plan_experts(c, s, i);
}

// Every output tensor in HF's order: embedding, the blocks, the final norm, lm_head. The plan
// stops at one entry more than the source has tensors: its names are distinct, so a longer plan
// has a missing tensor among its first n_tensors + 1, which bind names, and a config of 4096
// layers of 4096 experts (50 million tensors) costs what its weights file does.
static int plan(HfConversion *c, const HfShape *s, Err *err) {
    // 15 of the attention, norms and MLP; a router and 3 per expert instead of the MLP
    size_t per_block = 15 + (s->n_routed_experts ? 1 + 3 * (size_t)s->n_routed_experts : 0);
    size_t cap = (size_t)s->num_hidden_layers * per_block + 3;
    if (cap > (size_t)c->src.n_tensors + 1) cap = (size_t)c->src.n_tensors + 1;
    c->cap = (int)cap;
    c->entries = calloc(cap, sizeof *c->entries);
    if (!c->entries) return err_resource(err, "out of memory for the tensor plan");
    c->head_dim = s->head_dim;
    plan_add(c, "embed_tokens.weight", "model.embed_tokens.weight", "(vocab_size, hidden_size)",
             s->vocab_size, s->hidden_size, false);
    for (int i = 0; i < s->num_hidden_layers && c->n < c->cap; i++)
        plan_block(c, s, i);
    plan_add(c, "norm.weight", "model.norm.weight", "(hidden_size)", s->hidden_size, 0, false);
    if (!s->tie_word_embeddings)
        plan_add(c, "lm_head.weight", "lm_head.weight", "(vocab_size, hidden_size)", s->vocab_size,
                 s->hidden_size, false);
    return 0;
}

// ---------------------------------------------------------------- checking the source

static bool is_float(DType t) {
    return t == DT_F32 || t == DT_BF16 || t == DT_F16;
}

// " in FILE" for a tensor of a sharded set.
static const char *in_file(const StTensor *t, char *buf, size_t cap) {
    snprintf(buf, cap, "%s%s", t->file ? " in " : "", t->file ? t->file : "");
    return buf;
}

static int bind_entry(HfConversion *c, HfEntry *e, DType dtype, Err *err) {
    char want[64], got[64], where[300];
    st_format_shape(want, sizeof want, e->ndim, e->shape);
    const StTensor *t = st_find(&c->src, e->src);
    if (!t)
        return err_set(err, "%s: tensor '%s' is missing (expected shape %s %s)", c->src_path,
                       e->src, want, e->dims);
    st_format_shape(got, sizeof got, t->ndim, t->shape);
    if (t->ndim != e->ndim || t->shape[0] != e->shape[0] ||
        (e->ndim == 2 && t->shape[1] != e->shape[1]))
        return err_set(err, "%s: tensor '%s'%s has shape %s, expected %s %s", c->src_path, e->src,
                       in_file(t, where, sizeof where), got, want, e->dims);
    if (!is_float(t->dtype))
        return err_set(err, "%s: tensor '%s'%s is %s, not F32, BF16 or F16", c->src_path, e->src,
                       in_file(t, where, sizeof where), dtype_info(t->dtype)->safetensors);
    e->t = t;
    e->out = dtype == DT_N ? t->dtype : dtype;
    return 0;
}

// A buffer transformers computes from the config, found in old checkpoints: not a weight.
static bool is_derived_buffer(const char *name) {
    const char *suffix = ".rotary_emb.inv_freq";
    size_t n = strlen(name), k = strlen(suffix);
    return n > k && !strcmp(name + n - k, suffix);
}

// Every planned tensor present with its shape, and no source tensor left over.
static int bind(HfConversion *c, DType dtype, Err *err) {
    unsigned char *used = calloc((size_t)c->src.n_tensors + 1, 1);
    if (!used) return err_resource(err, "%s: out of memory", c->src_path);
    int rc = 0;
    for (int i = 0; i < c->n && !rc; i++)
        if (!(rc = bind_entry(c, &c->entries[i], dtype, err)))
            used[c->entries[i].t - c->src.tensors] = 1;
    for (int i = 0; i < c->src.n_tensors && !rc; i++) {
        const StTensor *t = &c->src.tensors[i];
        char where[300];
        if (!used[i] && !(c->import && is_derived_buffer(t->name)))
            rc = err_set(err, "%s: unexpected tensor '%s'%s (the config has no such weight)",
                         c->src_path, t->name, in_file(t, where, sizeof where));
    }
    free(used);
    return rc;
}

// ---------------------------------------------------------------- opening

static int open_source(HfConversion *c, const char *dir, Err *err) {
    char path[PATH_MAX];
    if (!shards_present(dir, "model") &&
        (!path_join(path, sizeof path, dir, "pytorch_model.bin", err) && fs_is_file(path)))
        return err_set(err,
                       "%s: only pytorch_model.bin, a pickle, which is never read: convert it to "
                       "model.safetensors first",
                       dir);
    if (!shards_present(dir, "model") &&
        (!path_join(path, sizeof path, dir, "pytorch_model.bin.index.json", err) &&
         fs_is_file(path)))
        return err_set(err,
                       "%s: only pytorch_model-*.bin shards, pickles, which are never read: "
                       "convert them to safetensors first",
                       dir);
    return shards_open(&c->src, dir, "model", c->src_path, sizeof c->src_path, err);
}

static int new_conversion(HfConversion **c, bool import, Err *err) {
    if (!(*c = calloc(1, sizeof **c))) return err_resource(err, "out of memory");
    (*c)->import = import;
    (*c)->n_shards = 1;
    return 0;
}

static int finish_open(HfConversion **c, int rc) {
    if (rc) {
        hf_close(*c);
        *c = NULL;
    }
    return rc;
}

int hf_open_import(HfConversion **c, const char *hf_dir, DType dtype, Err *err) {
    char path[PATH_MAX];
    HfShape shape;
    if (new_conversion(c, true, err)) return -1;
    int rc = path_join(path, sizeof path, hf_dir, "config.json", err) ||
             hf_config_import(path, &(*c)->config, &shape, err) || open_source(*c, hf_dir, err) ||
             plan(*c, &shape, err) || bind(*c, dtype, err);
    return finish_open(c, rc);
}

// The dtype of torch_dtype when each tensor keeps its own: the embedding's.
static DType export_dtype(const StFile *src, DType dtype) {
    const StTensor *embed = st_find(src, "embed_tokens.weight");
    if (dtype != DT_N) return dtype;
    return embed && is_float(embed->dtype) ? embed->dtype : DT_F32;
}

int hf_open_export(HfConversion **c, const char *astrai_dir, DType dtype, Err *err) {
    char path[PATH_MAX];
    HfShape shape;
    if (new_conversion(c, false, err)) return -1;
    int rc = path_join(path, sizeof path, astrai_dir, "config.json", err) ||
             open_source(*c, astrai_dir, err) ||
             hf_config_export(path, export_dtype(&(*c)->src, dtype), &(*c)->config, &shape, err) ||
             plan(*c, &shape, err) || bind(*c, dtype, err);
    return finish_open(c, rc);
}

void hf_close(HfConversion *c) {
    if (!c) return;
    st_close(&c->src);
    free(c->entries);
    cJSON_Delete(c->config);
    free(c);
}

const cJSON *hf_output_config(const HfConversion *c) {
    return c->config;
}

// ---------------------------------------------------------------- shards

static uint64_t entry_bytes(const HfEntry *e) {
    uint64_t n = (uint64_t)e->shape[0] * (uint64_t)(e->ndim == 2 ? e->shape[1] : 1);
    return n * dtype_size(e->out);
}

int hf_plan_shards(HfConversion *c, uint64_t max_shard_bytes) {
    uint64_t used = 0;
    int k = 0;
    for (int i = 0; i < c->n; i++) {
        uint64_t b = entry_bytes(&c->entries[i]);
        if (max_shard_bytes && used && used + b > max_shard_bytes) k++, used = 0;
        c->entries[i].shard = k;
        used += b;
    }
    return c->n_shards = k + 1;
}

static const char *shard_name(const HfConversion *c, int k, char *out, size_t cap) {
    if (c->n_shards == 1)
        snprintf(out, cap, "model.safetensors");
    else
        shards_file_name(out, cap, "model", k + 1, c->n_shards);
    return out;
}

char *hf_index_json(const HfConversion *c) {
    unsigned long failures = json_failures();
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(root, "metadata");
    cJSON *map = cJSON_AddObjectToObject(root, "weight_map");
    uint64_t total = 0;
    char name[64];
    for (int i = 0; i < c->n; i++) {
        total += entry_bytes(&c->entries[i]);
        cJSON_AddStringToObject(map, c->entries[i].dst,
                                shard_name(c, c->entries[i].shard, name, sizeof name));
    }
    cJSON_AddNumberToObject(meta, "total_size", (double)total);
    char *text = json_failures() == failures ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    return text;
}

// ---------------------------------------------------------------- writing

// The header of file k, {"__metadata__": {"format": "pt"}, name: {dtype, shape, data_offsets}}
// (transformers wants the format), padded with spaces to a multiple of 8 bytes.
static char *shard_header(const HfConversion *c, int k, size_t *len) {
    unsigned long failures = json_failures();
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(cJSON_AddObjectToObject(root, "__metadata__"), "format", "pt");
    uint64_t at = 0;
    for (int i = 0; i < c->n; i++) {
        const HfEntry *e = &c->entries[i];
        if (e->shard != k) continue;
        cJSON *o = cJSON_AddObjectToObject(root, e->dst);
        cJSON_AddStringToObject(o, "dtype", dtype_info(e->out)->safetensors);
        cJSON *shape = cJSON_AddArrayToObject(o, "shape"), *offs;
        for (int d = 0; d < e->ndim; d++)
            cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e->shape[d]));
        offs = cJSON_AddArrayToObject(o, "data_offsets");
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)at));
        at += entry_bytes(e);
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)at));
    }
    char *text = json_failures() == failures ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    size_t n = text ? strlen(text) : 0, padded = (n + 7) / 8 * 8;
    char *out = text ? realloc(text, padded + 1) : NULL;
    if (!out) return free(text), NULL;
    memset(out + n, ' ', padded - n);
    out[padded] = '\0';
    *len = padded;
    return out;
}

// Output bytes staged before fwrite, converted from the source dtype when it differs.
typedef struct {
    FILE *fp;
    size_t len;
    uint8_t buf[1 << 16];
} Out;

static int out_flush(Out *o) {
    size_t n = o->len;
    o->len = 0;
    return fwrite(o->buf, 1, n, o->fp) == n ? 0 : -1;
}

static float load_float(const uint8_t *p, DType t) {
    float f;
    if (t == DT_F32) return memcpy(&f, p, 4), f;
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    return t == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static void store_float(uint8_t *p, DType t, float f) {
    if (t == DT_F32) {
        memcpy(p, &f, 4);
        return;
    }
    uint16_t h = t == DT_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
    p[0] = (uint8_t)(h & 0xFF);
    p[1] = (uint8_t)(h >> 8);
}

// n elements of dtype `from` at src, written as dtype `to`.
static int out_put(Out *o, const uint8_t *src, DType from, DType to, size_t n) {
    size_t in = dtype_size(from), out = dtype_size(to);
    if (from == to) return out_flush(o) || fwrite(src, in, n, o->fp) != n ? -1 : 0;
    for (size_t i = 0; i < n; i++) {
        if (o->len + out > sizeof o->buf && out_flush(o)) return -1;
        store_float(o->buf + o->len, to, load_float(src + i * in, from));
        o->len += out;
    }
    return 0;
}

// The source row of output row r: within each head of D rows, import takes pair row 2i from
// half row i and 2i+1 from i + D/2; export inverts it.
static size_t source_row(const HfConversion *c, const HfEntry *e, size_t r) {
    size_t D = (size_t)c->head_dim, h = D / 2, head = r / D, j = r % D;
    if (!e->rope) return r;
    size_t from = c->import ? (j % 2 ? j / 2 + h : j / 2) : (j < h ? 2 * j : 2 * (j - h) + 1);
    return head * D + from;
}

// The source pages of a tensor are dropped once it is written: resident memory stays near one
// tensor, not the model (they are the file's, read again if ever touched).
static void release_source(const StTensor *t) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t begin = ((uintptr_t)t->bytes + page - 1) / page * page;
    uintptr_t end = ((uintptr_t)t->bytes + (t->end - t->begin)) / page * page;
    if (end > begin) madvise((void *)begin, end - begin, MADV_DONTNEED);
}

static int write_entry(Out *o, const HfConversion *c, const HfEntry *e) {
    const StTensor *t = e->t;
    size_t rows = (size_t)e->shape[0], cols = e->ndim == 2 ? (size_t)e->shape[1] : 1;
    size_t row_bytes = cols * dtype_size(t->dtype);
    int rc = 0;
    if (!e->rope) rc = out_put(o, t->bytes, t->dtype, e->out, rows * cols);
    for (size_t r = 0; e->rope && r < rows && !rc; r++)
        rc = out_put(o, t->bytes + source_row(c, e, r) * row_bytes, t->dtype, e->out, cols);
    release_source(t);
    return rc;
}

static int write_file(FILE *fp, const HfConversion *c, int k, const char *path, Err *err) {
    size_t len = 0;
    char *header = shard_header(c, k, &len);
    Out *o = malloc(sizeof *o);
    if (!header || !o) {
        free(header);
        free(o);
        return err_resource(err, "%s: out of memory", path);
    }
    uint8_t prefix[8];
    for (int i = 0; i < 8; i++)
        prefix[i] = (uint8_t)((uint64_t)len >> (8 * i));
    int rc = fwrite(prefix, 1, 8, fp) == 8 && fwrite(header, 1, len, fp) == len ? 0 : -1;
    *o = (Out){.fp = fp};
    for (int i = 0; i < c->n && !rc; i++)
        if (c->entries[i].shard == k) rc = write_entry(o, c, &c->entries[i]);
    if (!rc) rc = out_flush(o);
    free(header);
    free(o);
    return rc ? err_errno(err, errno, "%s: write failed", path) : 0;
}

int hf_write_shard(const HfConversion *c, int k, const char *path, Err *err) {
    FILE *fp = fopen(path, "wb");
    if (!fp) return err_errno(err, errno, "%s: cannot create", path);
    int rc = write_file(fp, c, k, path, err);
    if (!rc && (fflush(fp) || fsync(fileno(fp))))
        rc = err_errno(err, errno, "%s: write failed", path);
    if (fclose(fp) && !rc) rc = err_errno(err, errno, "%s: write failed", path);
    return rc;
}

// ---------------------------------------------------------------- in memory (param_path)

int hf_open_weights(StFile *f, const char *hf_dir, Err *err) {
    memset(f, 0, sizeof *f);
    HfConversion *c;
    if (hf_open_import(&c, hf_dir, DT_N, err)) return -1;
    int fd = memfd_create("astrai-hf-weights", MFD_CLOEXEC);
    if (fd < 0) {
        hf_close(c);
        return err_errno(err, errno, "%s: memfd_create for the converted weights", hf_dir);
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rc = hf_write_shard(c, 0, path, err) || st_open(f, path, err);
    close(fd);
    hf_close(c);
    return rc ? err_prefix(err, "%s: converting the weights in memory", hf_dir) : 0;
}
