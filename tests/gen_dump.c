// gen_dump: runs engine/generate.h on prompts and prints what test_generate_ref.py checks.
//
//   gen_dump MODEL_DIR PROMPTS.txt [KEY=VALUE...]
//
// PROMPTS.txt: one prompt per line, token ids separated by spaces. Keys: dtype (fp32, bf16,
// fp16), no_cache (0/1), max_tokens, temperature, top_k, top_p, frequency_penalty, rep_window,
// seed, first_sequence, stop (ids separated by commas), repeat (each line stands for that many
// prompts in a row: line l's copy c is prompt l * repeat + c, sequence index first_sequence plus
// that; the sampling statistics of tests/test_generate_stats.py). Prints one JSON array: per
// prompt its "tokens", "logprobs", "model_logprobs" and "stopped".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"

enum { MAX_PROMPTS = 64, MAX_PROMPT = 4096, MAX_STOP = 16 };

typedef struct {
    DType dtype;
    int repeat; // >= 1
    GenerateOptions gen;
    int32_t stop[MAX_STOP];
} Args;

static int parse_stop(Args *a, const char *v, Err *err) {
    for (a->gen.n_stop = 0; *v; a->gen.n_stop++) {
        if (a->gen.n_stop == MAX_STOP) return err_set(err, "stop: more than %d ids", MAX_STOP);
        char *end;
        a->stop[a->gen.n_stop] = (int32_t)strtol(v, &end, 10);
        if (end == v) return err_set(err, "stop: '%s' is not a list of ids", v);
        v = *end == ',' ? end + 1 : end;
    }
    a->gen.stop = a->stop;
    return 0;
}

static int key_is(const char *arg, size_t k, const char *name) {
    return strlen(name) == k && !strncmp(arg, name, k);
}

static int parse_arg(Args *a, const char *arg, Err *err) {
    const char *eq = strchr(arg, '=');
    if (!eq) return err_set(err, "argument '%s': expected KEY=VALUE", arg);
    const char *v = eq + 1;
    size_t k = (size_t)(eq - arg);
    SampleOptions *s = &a->gen.sample;
    if (key_is(arg, k, "dtype"))
        a->dtype = !strcmp(v, "bf16") ? DT_BF16 : !strcmp(v, "fp16") ? DT_F16 : DT_F32;
    else if (key_is(arg, k, "no_cache"))
        a->gen.no_cache = atoi(v) != 0;
    else if (key_is(arg, k, "max_tokens"))
        a->gen.max_tokens = atoi(v);
    else if (key_is(arg, k, "temperature"))
        s->temperature = strtof(v, NULL);
    else if (key_is(arg, k, "top_k"))
        s->top_k = atoi(v);
    else if (key_is(arg, k, "top_p"))
        s->top_p = strtof(v, NULL);
    else if (key_is(arg, k, "frequency_penalty"))
        s->frequency_penalty = strtof(v, NULL);
    else if (key_is(arg, k, "rep_window"))
        s->rep_window = atoi(v);
    else if (key_is(arg, k, "seed"))
        s->seed = strtoull(v, NULL, 10);
    else if (key_is(arg, k, "first_sequence"))
        a->gen.first_sequence = strtoull(v, NULL, 10);
    else if (key_is(arg, k, "stop"))
        return parse_stop(a, v, err);
    else if (key_is(arg, k, "repeat")) {
        a->repeat = atoi(v);
        if (a->repeat < 1 || a->repeat > 1 << 20) return err_set(err, "repeat: '%s'", v);
    } else
        return err_set(err, "argument '%s': unknown key", arg);
    return 0;
}

// prompts[b] (lens[b] ids) of each line of path; returns B or -1.
static int read_prompts(const char *path, int32_t *prompts[MAX_PROMPTS], int lens[MAX_PROMPTS],
                        Err *err) {
    FILE *f = fopen(path, "r");
    if (!f) return err_set(err, "%s: cannot open", path);
    static char line[16 * MAX_PROMPT];
    int B = 0;
    while (B < MAX_PROMPTS && fgets(line, sizeof line, f)) {
        if (!(prompts[B] = malloc(MAX_PROMPT * sizeof *prompts[B]))) break;
        char *p = line, *end;
        for (lens[B] = 0; lens[B] < MAX_PROMPT; lens[B]++, p = end) {
            long id = strtol(p, &end, 10);
            if (end == p) break;
            prompts[B][lens[B]] = (int32_t)id;
        }
        B++;
    }
    fclose(f);
    return B;
}

static void print_floats(const float *x, int n) {
    for (int i = 0; i < n; i++)
        printf("%s%.9g", i ? ", " : "", x[i]);
}

static void print_generations(const Generation *g, int B) {
    printf("[");
    for (int b = 0; b < B; b++) {
        printf("%s{\"tokens\": [", b ? ", " : "");
        for (int i = 0; i < g[b].n; i++)
            printf("%s%d", i ? ", " : "", g[b].tokens[i]);
        printf("], \"logprobs\": [");
        print_floats(g[b].logprobs, g[b].n);
        printf("], \"model_logprobs\": [");
        print_floats(g[b].model_logprobs, g[b].n);
        printf("], \"stopped\": %s}", g[b].stopped ? "true" : "false");
    }
    printf("]\n");
}

// Generates each of the B prompts a->repeat times in a row into *g, which it allocates (the
// caller frees it, also after a failure) and prints them.
static int generate_repeated(Model *m, int B, int32_t *const *prompts, const int *lens,
                             const Args *a, Generation **g, Err *err) {
    int n = B * a->repeat;
    const int32_t **seq = malloc((size_t)n * sizeof *seq);
    int *seq_lens = malloc((size_t)n * sizeof *seq_lens);
    *g = calloc((size_t)n, sizeof **g);
    int rc = seq && seq_lens && *g ? 0 : err_set(err, "gen_dump: out of memory (%d prompts)", n);
    for (int i = 0; !rc && i < n; i++) {
        seq[i] = prompts[i / a->repeat];
        seq_lens[i] = lens[i / a->repeat];
    }
    if (!rc) rc = generate(m, seq, seq_lens, n, &a->gen, *g, err);
    if (!rc) print_generations(*g, n);
    free(seq);
    free(seq_lens);
    return rc;
}

static int run(const char *dir, int B, int32_t *const *prompts, const int *lens, const Args *a,
               Err *err) {
    char path[4096];
    ModelConfig cfg;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (model_config_load(&cfg, path, err)) return -1;
    Model m;
    if (model_create(&m, &cfg, backend_cpu_dtype(a->dtype), err)) return -1;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    Generation *g = NULL;
    int rc = model_load(&m, path, err);
    if (!rc) rc = generate_repeated(&m, B, prompts, lens, a, &g, err);
    if (g) generation_free(g, B * a->repeat);
    free(g);
    model_free(&m);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL_DIR PROMPTS.txt [KEY=VALUE...]\n", argv[0]);
        return EXIT_BAD_INPUT;
    }
    Err err = {0};
    Args a = {
        .dtype = DT_F32, .repeat = 1, .gen = {.sample = SAMPLE_OPTIONS_DEFAULT, .max_tokens = 8}};
    a.gen.sample.temperature = 0.0f;
    int32_t *prompts[MAX_PROMPTS] = {0};
    int lens[MAX_PROMPTS] = {0}, rc = 0, B = 0;
    for (int i = 3; i < argc && !rc; i++)
        rc = parse_arg(&a, argv[i], &err);
    if (!rc && (B = read_prompts(argv[2], prompts, lens, &err)) < 0) rc = -1;
    if (!rc) rc = run(argv[1], B, prompts, lens, &a, &err);
    for (int b = 0; b < MAX_PROMPTS; b++)
        free(prompts[b]);
    if (rc) fprintf(stderr, "gen_dump: %s\n", err.msg);
    return rc ? err_exit_status(&err) : 0;
}
