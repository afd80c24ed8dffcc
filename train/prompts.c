// prompts.c: prompt files, stop tokens and completion text (train/prompts.h).
#include "train/prompts.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "data/conversation.h"
#include "data/jsonl.h"

static int check_prompt(const Prompt *p, const PromptLimits *lim, Err *err) {
    if (p->n == 0) return err_set(err, "the prompt has no tokens");
    if (p->n > lim->context - lim->max_tokens + 1)
        return err_set(err,
                       "the prompt has %d tokens: with %s %d it passes the model's "
                       "max_position_embeddings %d",
                       p->n, lim->max_tokens_flag, lim->max_tokens, lim->context);
    for (int i = 0; i < p->n; i++)
        if (p->ids[i] >= lim->vocab)
            return err_set(err,
                           "the prompt's token %d is id %d, outside the model's vocab_size %d "
                           "(a tokenizer of another model?)",
                           i, p->ids[i], lim->vocab);
    return 0;
}

int prompts_add_text(PromptList *l, const Tokenizer *tok, const char *text, size_t len,
                     const PromptLimits *lim, Err *err) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        Prompt *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return err_resource(err, "out of memory for %d prompts", cap);
        l->v = v, l->cap = cap;
    }
    Prompt *p = &l->v[l->n];
    int32_t *ids;
    int64_t n;
    if (!(p->text = strndup(text, len))) return err_resource(err, "out of memory for a prompt");
    if (tokenizer_encode(tok, text, len, &ids, &n, err)) return free(p->text), -1;
    if (n > INT32_MAX) return free(p->text), free(ids), err_set(err, "the prompt is too long");
    p->ids = ids, p->n = (int)n, l->n++;
    return check_prompt(p, lim, err);
}

void prompts_free(PromptList *l) {
    for (int i = 0; i < l->n; i++)
        free(l->v[i].text), free(l->v[i].ids);
    free(l->v);
    memset(l, 0, sizeof *l);
}

typedef struct {
    PromptList *l;
    const Tokenizer *tok;
    const char *template_file;
    ChatTemplate *template; // at the first conversation: a file of plain prompts needs none
    ChatVars vars;
    const PromptLimits *lim;
    int allow_instruction;
} JsonlCtx;

static int render(JsonlCtx *c, const ChatMessage *msgs, int n, Err *err) {
    char *text = NULL;
    size_t len = 0;
    if ((!c->template && conversation_template(c->tok, c->template_file, &c->template, err)) ||
        chat_template_render(c->template, msgs, n, &c->vars, &text, &len, err))
        return -1;
    int rc = prompts_add_text(c->l, c->tok, text, len, c->lim, err);
    free(text);
    return rc;
}

static int render_messages(JsonlCtx *c, const cJSON *list, Err *err) {
    ChatMessage *msgs = NULL;
    int n = 0;
    int rc = conversation_messages(list, &msgs, &n, err) || render(c, msgs, n, err);
    free(msgs);
    return rc ? -1 : 0;
}

// AstrAI's rollout: instruction -> system, input -> user, output -> assistant, empty ones
// skipped (a record of only an instruction is a system message the template answers).
static int render_instruction(JsonlCtx *c, const cJSON *rec, Err *err) {
    static const char *const KEYS[] = {"instruction", "input", "output"};
    static const char *const ROLES[] = {"system", "user", "assistant"};
    ChatMessage msgs[3];
    int n = 0;
    for (const cJSON *f = rec->child; f; f = f->next) {
        int k = 0;
        while (k < 3 && strcmp(f->string, KEYS[k]))
            k++;
        if (k == 3)
            return err_set(err,
                           "\"%s\": a record of \"instruction\"/\"input\"/\"output\" holds "
                           "nothing else",
                           f->string);
        if (!cJSON_IsString(f)) return err_set(err, "\"%s\" is not a string", f->string);
    }
    for (int k = 0; k < 3; k++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(rec, KEYS[k]);
        if (f && *f->valuestring)
            msgs[n++] = (ChatMessage){.role = ROLES[k], .content = f->valuestring};
    }
    if (!n) return err_set(err, "the record's \"instruction\", \"input\" and \"output\" are empty");
    return render(c, msgs, n, err);
}

// One line (a jsonl_each callback).
static int add_record(const cJSON *rec, void *ctx, Err *err) {
    JsonlCtx *c = ctx;
    if (!cJSON_IsObject(rec) || !rec->child) goto bad;
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(rec, "prompt");
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(rec, "messages");
    bool one = !rec->child->next;
    if (one && messages) return render_messages(c, messages, err);
    if (one && prompt) {
        if (!cJSON_IsString(prompt)) return err_set(err, "\"prompt\" is not a string");
        return prompts_add_text(c->l, c->tok, prompt->valuestring, strlen(prompt->valuestring),
                                c->lim, err);
    }
    if (c->allow_instruction && cJSON_GetObjectItemCaseSensitive(rec, "instruction"))
        return render_instruction(c, rec, err);
bad:
    return err_set(err, c->allow_instruction
                            ? "a line must be {\"prompt\": TEXT}, {\"messages\": [...]} or "
                              "{\"instruction\": ..., \"input\": ..., \"output\": ...}"
                            : "a line must be {\"prompt\": TEXT} or {\"messages\": [...]}");
}

int prompts_read_jsonl(PromptList *l, const char *path, const Tokenizer *tok,
                       const char *template_file, int allow_instruction, const PromptLimits *lim,
                       Err *err) {
    JsonlCtx c = {.l = l,
                  .tok = tok,
                  .template_file = template_file,
                  .lim = lim,
                  .allow_instruction = allow_instruction};
    if (conversation_vars(tok, &c.vars, err)) return -1;
    c.vars.add_generation_prompt = 1;
    int before = l->n;
    int rc = jsonl_each(path, add_record, &c, NULL, NULL, err);
    chat_template_free(c.template);
    if (!rc && l->n == before) rc = err_set(err, "%s: no prompts", path);
    return rc;
}

// ---------------------------------------------------------------- stop tokens

typedef struct {
    int32_t *v;
    int *n;
    int vocab;
} Stops;

static int add_stop(Stops *s, long id, const char *what, Err *err) {
    if (id < 0 || id >= s->vocab)
        return err_set(err, "%s: stop token %ld outside the model's vocab_size %d", what, id,
                       s->vocab);
    for (int i = 0; i < *s->n; i++)
        if (s->v[i] == id) return 0;
    if (*s->n == PROMPTS_MAX_STOP)
        return err_set(err, "%s: more than %d stop tokens", what, PROMPTS_MAX_STOP);
    s->v[(*s->n)++] = (int32_t)id;
    return 0;
}

// One id of generation_config.json's "eos_token_id".
static int add_json_stop(Stops *s, const cJSON *x, const char *path, Err *err) {
    double v = cJSON_IsNumber(x) ? x->valuedouble : -1;
    if (!(v >= 0 && v < s->vocab && v == (long)v))
        return err_set(err, "%s: \"eos_token_id\": not a token id of the model's vocab_size %d",
                       path, s->vocab);
    return add_stop(s, (long)v, path, err);
}

static int generation_config_stops(Stops *s, const char *dir, Err *err) {
    char path[4096];
    cJSON *root = NULL;
    if (path_join(path, sizeof path, dir, "generation_config.json", err)) return -1;
    if (!fs_is_file(path)) return 0;
    if (json_read_file(path, &root, err)) return -1;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"), *x;
    int rc = 0;
    if (cJSON_IsArray(e)) {
        cJSON_ArrayForEach(x, e) if (!rc) rc = add_json_stop(s, x, path, err);
    } else if (e && !cJSON_IsNull(e)) {
        rc = add_json_stop(s, e, path, err);
    }
    cJSON_Delete(root);
    return rc;
}

int prompts_stop_tokens(const Tokenizer *tok, const char *model_dir, int vocab, int32_t *stop,
                        int *n, Err *err) {
    Stops s = {.v = stop, .n = n, .vocab = vocab};
    *n = 0;
    const char *eos = tokenizer_config_string(tok, "eos_token");
    int id = eos ? tokenizer_token_id(tok, eos) : -1;
    if (eos && id < 0)
        return err_set(err, "tokenizer_config.json: eos_token '%s' is not a token", eos);
    if (id >= 0 && add_stop(&s, id, "tokenizer_config.json eos_token", err)) return -1;
    return generation_config_stops(&s, model_dir, err);
}

int prompts_open_tokenizer(const char *spec, const char *model_dir, const char *flag,
                           Tokenizer **tok, Err *err) {
    char path[4096];
    if (!spec || !*spec) {
        if (path_join(path, sizeof path, model_dir, "tokenizer.json", err)) return -1;
        spec = fs_is_file(path) ? model_dir : "bytes";
    }
    if (tokenizer_open(spec, tok, err)) return err_prefix(err, "%s %s", flag, spec);
    return 0;
}

// ---------------------------------------------------------------- completions

// text[0..len) with each NUL byte as U+FFFD, into a new string (text freed); NULL when out of
// memory.
static char *replace_nul(char *text, size_t len) {
    size_t nul = 0;
    for (size_t i = 0; i < len; i++)
        nul += !text[i];
    if (!nul) return text;
    char *out = malloc(len + 2 * nul + 1), *o = out;
    for (size_t i = 0; out && i < len; i++)
        o = text[i] ? (*o = text[i], o + 1) : (memcpy(o, "\xEF\xBF\xBD", 3), o + 3);
    if (out) *o = '\0';
    free(text);
    return out;
}

int prompts_completion_text(const Tokenizer *tok, const Generation *g, char **text, Err *err) {
    size_t len;
    if (tokenizer_decode(tok, g->tokens, g->n - g->stopped, 1, text, &len, err))
        return err_prefix(err, "decoding the completion");
    if (!(*text = replace_nul(*text, len))) return err_resource(err, "out of memory for a text");
    return 0;
}
