// astrai-generate: text from a model (engine/generate.h: prefill, then one token at a time with
// a KV cache, sampled as AstrAI samples), one JSON line per prompt (docs/generate.md).
//
//   astrai-generate --param_path DIR (--prompt TEXT... | --prompts FILE.jsonl) [options]
//
// DIR: a model directory, a checkpoint of either layout or a Hugging Face directory (the loader
// of astrai-train). Prompts run in batches of --batch_size, prompt i being the sampler's
// sequence i: a completion does not depend on the batch size. When stdout is a terminal (or
// with --stream) the prompts run one at a time and each completion's text is written to stdout
// as its tokens come, then its JSON line (to --out, else stdout).
#include <cblas.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/model_dir.h"
#include "common/error.h"
#include "common/flags.h"
#include "common/json.h"
#include "data/tokenizer.h"
#include "engine/backend.h"
#include "engine/generate.h"
#include "proto/rpc.h" // rpc_utf8_sanitize: every line we print is valid UTF-8
#include "train/prompts.h"
#include "train/train_ckpt.h"

typedef struct {
    const char **v;
    int n, cap;
} StrList;

typedef struct {
    const char *param_path, *tokenizer, *prompts_file, *chat_template, *out;
    const char *device_type, *dtype;
    StrList prompt;
    GenerateOptions gen;
    int batch_size, threads;
    bool stream;
} Args;

// ---------------------------------------------------------------- flags

static int parse_append(const Flag *f, const char *s, Err *err) {
    StrList *l = f->target;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        const char **v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return err_resource(err, "--%s: out of memory", f->name);
        l->v = v, l->cap = cap;
    }
    l->v[l->n++] = s;
    return 0;
}

// FLAG_PARSED data of an integer or a real flag: its range.
typedef struct {
    double min, max;
    bool above_min; // (min, max] rather than [min, max]
} Range;

static int parse_real(const Flag *f, const char *s, double *v, Err *err) {
    const Range *r = f->data;
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    bool low = r->above_min ? *v <= r->min : *v < r->min;
    if (*s == '\0' || *end != '\0' || errno || !isfinite(*v) || low || *v > r->max)
        return err_set(err, "--%s '%s' is not a number in %c%.15g, %.15g]", f->name, s,
                       r->above_min ? '(' : '[', r->min, r->max);
    return 0;
}

static int parse_int(const Flag *f, const char *s, Err *err) {
    double v;
    if (parse_real(f, s, &v, err)) return -1;
    if (v != (int)v) return err_set(err, "--%s '%s' is not an integer", f->name, s);
    *(int *)f->target = (int)v;
    return 0;
}

static int parse_float(const Flag *f, const char *s, Err *err) {
    double v;
    if (parse_real(f, s, &v, err)) return -1;
    *(float *)f->target = (float)v;
    return 0;
}

static const Range TOKENS = {1, 1 << 20, false}, POSITIVE = {1, 1024, false},
                   COUNT = {0, 1 << 30, false}, TEMPERATURE = {0, 1e6, false}, PROB = {0, 1, true},
                   PENALTY = {-1e6, 1e6, false}, THREADS = {0, 4096, false};

#define FLAG_S(n, t, h, vn)                                                                        \
    { .name = n, .kind = FLAG_STRING, .target = t, .help = h, .value_name = vn }
#define FLAG_P(n, t, fn, r, h, vn)                                                                 \
    {                                                                                              \
        .name = n, .kind = FLAG_PARSED, .target = t, .parse = fn, .data = r, .help = h,            \
        .value_name = vn                                                                           \
    }

// The flag table (a macro: the usage and the parser read the same one).
#define GENERATE_FLAGS(a)                                                                          \
    {                                                                                              \
        FLAG_S("param_path", &(a)->param_path,                                                     \
               "model directory, checkpoint (full or sharded) or Hugging Face directory", "DIR"),  \
            FLAG_S("tokenizer", &(a)->tokenizer,                                                   \
                   "bytes, or a tokenizer.json (or its directory); default: DIR's, else bytes",    \
                   "bytes|PATH"),                                                                  \
            FLAG_P("prompt", &(a)->prompt, parse_append, NULL, "a prompt (repeatable)", "TEXT"),   \
            FLAG_S("prompts", &(a)->prompts_file,                                                  \
                   "one {\"prompt\": TEXT} or {\"messages\": [...]} a line", "FILE.jsonl"),        \
            FLAG_S("chat_template", &(a)->chat_template,                                           \
                   "renders \"messages\" (default: the tokenizer's chat_template)", "FILE"),       \
            FLAG_P("max_tokens", &(a)->gen.max_tokens, parse_int, &TOKENS,                         \
                   "most tokens generated per prompt (default 128)", "N"),                         \
            FLAG_P("temperature", &(a)->gen.sample.temperature, parse_float, &TEMPERATURE,         \
                   "0: greedy (default 1)", "T"),                                                  \
            FLAG_P("top_k", &(a)->gen.sample.top_k, parse_int, &COUNT, "0: off (default)", "K"),   \
            FLAG_P("top_p", &(a)->gen.sample.top_p, parse_float, &PROB, "1: off (default)", "P"),  \
            FLAG_P("frequency_penalty", &(a)->gen.sample.frequency_penalty, parse_float, &PENALTY, \
                   "0: off (default)", "F"),                                                       \
            FLAG_P("rep_window", &(a)->gen.sample.rep_window, parse_int, &COUNT,                   \
                   "prompt tokens the penalty counts (default 64)", "W"),                          \
            FLAG_P("seed", &(a)->gen.sample.seed, flags_parse_u64, NULL,                           \
                   "the draws' stream (default 0)", "S"),                                          \
            FLAG_P("batch_size", &(a)->batch_size, parse_int, &POSITIVE,                           \
                   "prompts generated together (default 16)", "N"),                                \
            FLAG_S("device_type", &(a)->device_type, "auto|cpu|cuda (default auto)", "DEVICE"),    \
            FLAG_S("dtype", &(a)->dtype, "auto|bf16|fp16|fp32 (auto: bf16 on cuda, fp32 on cpu)",  \
                   "DTYPE"),                                                                       \
            FLAG_P("threads", &(a)->threads, parse_int, &THREADS, "CPU threads (0: all, default)", \
                   "N"),                                                                           \
            FLAG_S("out", &(a)->out, "the JSON lines' file (default stdout)", "FILE"), {           \
            .name = "stream", .kind = FLAG_SWITCH, .target = &(a)->stream, .negatable = true,      \
            .help = "write the text as it comes (default: when stdout is a terminal)"              \
        }                                                                                          \
    }

static void usage(FILE *f) {
    Args a;
    const Flag flags[] = GENERATE_FLAGS(&a);
    fputs("usage: astrai-generate --param_path DIR (--prompt TEXT... | --prompts FILE.jsonl) "
          "[options]\n"
          "  one JSON line per prompt: {\"prompt\", \"completion\", \"tokens\", \"logprobs\", "
          "\"stopped\"}\n",
          f);
    flags_usage(f, flags, sizeof flags / sizeof *flags);
    fputs("exit status: 0 ok, 1 failure (memory, device, i/o), 2 bad input\n", f);
}

static int check_args(const Args *a, Err *err) {
    if (!a->param_path) return err_set(err, "--param_path is required");
    if (a->prompt.n && a->prompts_file)
        return err_set(err, "give --prompt TEXT (repeatable) or --prompts FILE.jsonl, not both");
    if (!a->prompt.n && !a->prompts_file)
        return err_set(err, "no prompt: give --prompt TEXT (repeatable) or --prompts FILE.jsonl");
    if (a->chat_template && !a->prompts_file)
        return err_set(err, "--chat_template renders --prompts' \"messages\": no --prompts given");
    return sample_options_check(&a->gen.sample, err);
}

static int parse_args(Args *a, int argc, char **argv, Err *err) {
    *a = (Args){.gen = {.sample = SAMPLE_OPTIONS_DEFAULT, .max_tokens = 128},
                .batch_size = 16,
                .device_type = "auto",
                .dtype = "auto",
                .stream = isatty(STDOUT_FILENO)};
    const Flag flags[] = GENERATE_FLAGS(a);
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc - 1, argv + 1, NULL, err)) return -1;
    return check_args(a, err);
}

// ---------------------------------------------------------------- model, tokenizer, stops

// --device_type / --dtype as astrai-train takes them (auto: cuda when a GPU is visible; bf16
// on cuda, fp32 on the CPU).
static int open_backend(const Args *a, const Backend **be, Err *err) {
    const char *d = a->device_type, *t = a->dtype;
    if (strcmp(d, "auto") && strcmp(d, "cpu") && strcmp(d, "cuda"))
        return err_set(err, "--device_type '%s' is not one of auto, cpu, cuda", d);
    bool cuda = !strcmp(d, "cuda") || (!strcmp(d, "auto") && backend_cuda_available());
    DType dt = !strcmp(t, "fp32") ? DT_F32 : !strcmp(t, "bf16") ? DT_BF16 : DT_F16;
    if (!strcmp(t, "auto"))
        dt = cuda ? DT_BF16 : DT_F32;
    else if (strcmp(t, "fp32") && strcmp(t, "bf16") && strcmp(t, "fp16"))
        return err_set(err, "--dtype '%s' is not one of auto, bf16, fp16, fp32", t);
    return backend_open(be, cuda ? BACKEND_CUDA : BACKEND_CPU, 0, dt, err);
}

static int load_model(const Args *a, Model *m, Err *err) {
    ModelConfig cfg;
    const Backend *be;
    if (ckpt_model_config(&cfg, a->param_path, err) || open_backend(a, &be, err) ||
        train_ckpt_load_model(m, &cfg, 0, cfg.num_hidden_layers, be, a->param_path, err))
        return err_prefix(err, "--param_path %s", a->param_path);
    model_release(m, MODEL_GRADS);
    return 0;
}

// --tokenizer, else DIR/tokenizer.json (with its tokenizer_config.json), else bytes.
static int open_tokenizer(const Args *a, Tokenizer **tok, Err *err) {
    return prompts_open_tokenizer(a->tokenizer, a->param_path, "--tokenizer", tok, err);
}

// The stop tokens: the tokenizer's eos_token and DIR's generation_config.json's.
static int find_stops(Args *a, const Tokenizer *tok, int V, int32_t *stop, Err *err) {
    if (prompts_stop_tokens(tok, a->param_path, V, stop, &a->gen.n_stop, err)) return -1;
    a->gen.stop = stop;
    return 0;
}

// ---------------------------------------------------------------- prompts

static int read_prompts(const Args *a, const Tokenizer *tok, const ModelConfig *cfg, PromptList *l,
                        Err *err) {
    PromptLimits lim = {cfg->vocab_size, cfg->max_position_embeddings, a->gen.max_tokens,
                        "--max_tokens"};
    for (int i = 0; i < a->prompt.n; i++)
        if (prompts_add_text(l, tok, a->prompt.v[i], strlen(a->prompt.v[i]), &lim, err))
            return err_prefix(err, "--prompt %d", i + 1);
    if (!a->prompts_file) return 0;
    return prompts_read_jsonl(l, a->prompts_file, tok, a->chat_template, 0, &lim, err);
}

// ---------------------------------------------------------------- output

typedef struct {
    const Tokenizer *tok;
    int max_tokens;
    size_t shown; // bytes of the completion's text written so far
} Stream;

// The bytes of text[0..len) that more tokens will not change: without a trailing U+FFFD or a
// trailing cut UTF-8 sequence (the next token may complete either).
static size_t settled_len(const char *text, size_t len) {
    while (len >= 3 && !memcmp(text + len - 3, "\xEF\xBF\xBD", 3))
        len -= 3;
    for (size_t k = 1; k <= 3 && k <= len; k++) {
        unsigned char c = (unsigned char)text[len - k];
        if ((c & 0xC0) == 0x80) continue; // a continuation byte: look further back
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > k ? len - k : len;
    }
    return len;
}

// Writes the completion's text that has settled (all of it after the last token), valid UTF-8.
static int stream_token(void *ctx, int b, const Generation *g, Err *err) {
    (void)b;
    Stream *s = ctx;
    char *text, *part;
    if (prompts_completion_text(s->tok, g, &text, err)) return -1;
    size_t len = strlen(text);
    if (!g->stopped && g->n < s->max_tokens) len = settled_len(text, len);
    if (len > s->shown) {
        if (!(part = strndup(text + s->shown, len - s->shown)) || !(part = rpc_utf8_sanitize(part)))
            return free(text), err_resource(err, "out of memory streaming a completion");
        fputs(part, stdout);
        fflush(stdout);
        free(part);
        s->shown = len;
    }
    free(text);
    return 0;
}

static cJSON *json_result(const Prompt *p, const char *completion, const Generation *g) {
    cJSON *o = cJSON_CreateObject(), *tokens = cJSON_CreateArray(), *lps = cJSON_CreateArray();
    cJSON_AddItemToObject(o, "prompt", cJSON_CreateString(p->text));
    cJSON_AddItemToObject(o, "completion", cJSON_CreateString(completion));
    for (int i = 0; i < g->n; i++) {
        cJSON_AddItemToArray(tokens, cJSON_CreateNumber(g->tokens[i]));
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(g->model_logprobs[i]));
    }
    cJSON_AddItemToObject(o, "tokens", tokens);
    cJSON_AddItemToObject(o, "logprobs", lps);
    cJSON_AddItemToObject(o, "stopped", cJSON_CreateBool(g->stopped));
    return o;
}

static int write_result(FILE *out, const Tokenizer *tok, const Prompt *p, const Generation *g,
                        Err *err) {
    char *completion, *line = NULL;
    if (prompts_completion_text(tok, g, &completion, err)) return -1;
    cJSON *o = json_result(p, completion, g);
    free(completion);
    if (!json_out_of_memory()) line = rpc_utf8_sanitize(cJSON_PrintUnformatted(o));
    cJSON_Delete(o);
    if (!line) return err_resource(err, "out of memory for a result line");
    int rc = fprintf(out, "%s\n", line) < 0 || fflush(out) ? err_errno(err, errno, "writing") : 0;
    free(line);
    return rc;
}

// ---------------------------------------------------------------- generation

// Prompts [first, first + B) as one batch, sequences first.. of the sampler.
static int generate_batch(Model *m, const Args *a, const Tokenizer *tok, const PromptList *l,
                          int first, int B, FILE *out, Err *err) {
    const int32_t *ids[B];
    int lens[B];
    Generation g[B];
    for (int b = 0; b < B; b++)
        ids[b] = l->v[first + b].ids, lens[b] = l->v[first + b].n;
    GenerateOptions o = a->gen;
    Stream s = {.tok = tok, .max_tokens = a->gen.max_tokens};
    o.first_sequence = (uint64_t)first;
    if (a->stream) o.on_token = stream_token, o.on_token_ctx = &s;
    if (a->stream) printf("%s", l->v[first].text);
    int rc = generate(m, ids, lens, B, &o, g, err);
    if (a->stream) printf("\n");
    for (int b = 0; b < B && !rc; b++)
        if (write_result(out, tok, &l->v[first + b], &g[b], err))
            rc = err_prefix(err, "prompt %d", first + b + 1);
    generation_free(g, B);
    return rc;
}

static int generate_all(Model *m, Args *a, const Tokenizer *tok, const PromptList *l, Err *err) {
    FILE *out = a->out ? fopen(a->out, "w") : stdout;
    if (!out) return err_errno(err, errno, "--out %s", a->out);
    // A backend without attention_decode (docs/design.md §10): every step recomputes the sequences.
    a->gen.no_cache = !m->be->attention_decode;
    if (a->gen.no_cache) fprintf(stderr, "astrai-generate: no KV cache on this backend\n");
    int step = a->stream ? 1 : a->batch_size, rc = 0;
    for (int first = 0; first < l->n && !rc; first += step) {
        int B = l->n - first < step ? l->n - first : step;
        if (generate_batch(m, a, tok, l, first, B, out, err))
            rc = B == 1 ? err_prefix(err, "prompt %d", first + 1)
                        : err_prefix(err, "prompts %d-%d", first + 1, first + B);
    }
    if (out != stdout && fclose(out) && !rc) rc = err_errno(err, errno, "--out %s", a->out);
    return rc;
}

static int run(Args *a, Err *err) {
    Model m = {0};
    Tokenizer *tok = NULL;
    PromptList l = {0};
    int32_t stop[PROMPTS_MAX_STOP];
    if (a->threads > 0) omp_set_num_threads(a->threads), openblas_set_num_threads(a->threads);
    int rc = load_model(a, &m, err) || open_tokenizer(a, &tok, err) ||
             find_stops(a, tok, m.cfg.vocab_size, stop, err) ||
             read_prompts(a, tok, &m.cfg, &l, err) || generate_all(&m, a, tok, &l, err);
    prompts_free(&l);
    tokenizer_free(tok);
    model_free(&m);
    return rc ? -1 : 0;
}

int main(int argc, char **argv) {
    json_init();
    if (flags_want_help(argc - 1, argv + 1)) return usage(stdout), 0;
    Err err = {0};
    Args a;
    int rc = parse_args(&a, argc, argv, &err) || run(&a, &err);
    free(a.prompt.v);
    if (!rc) return 0;
    fprintf(stderr, "astrai-generate: %s\n", err.msg);
    return err_exit_status(&err);
}
