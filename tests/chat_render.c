// chat_render: the chat template renderer for tests/test_chat_template.py.
//   chat_render TEMPLATE CONV.json
// CONV.json: {"messages": [{"role", "content"}...], "add_generation_prompt": bool,
// "bos_token", "eos_token": strings (absent: undefined), "now": seconds (strftime_now),
// "spans": bool}. Prints the rendering's bytes; with "spans" true instead the JSON
// {"text": rendering, "spans": [[begin, end], ...]} of chat_template_assistant_spans.
// Errors: the message on stderr, exit 2 (1 for want of memory).
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "data/chat_template.h"

static const char *string_member(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int read_messages(const cJSON *conv, ChatMessage **msgs, int *n, Err *err) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(conv, "messages");
    if (!cJSON_IsArray(list)) return err_set(err, "\"messages\" is not a list");
    *n = cJSON_GetArraySize(list);
    *msgs = calloc((size_t)*n + 1, sizeof **msgs);
    if (!*msgs) return err_resource(err, "out of memory for %d messages", *n);
    int i = 0;
    for (const cJSON *m = list->child; m; m = m->next, i++) {
        (*msgs)[i] = (ChatMessage){string_member(m, "role"), string_member(m, "content")};
        if (!(*msgs)[i].role || !(*msgs)[i].content)
            return err_set(err, "messages[%d] needs string \"role\" and \"content\"", i);
    }
    return 0;
}

static int print_spans(const char *text, size_t len, const ChatSpan *spans, int n, Err *err) {
    cJSON *o = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(o, "spans");
    cJSON_AddStringToObject(o, "text", text);
    for (int i = 0; i < n; i++) {
        const double pair[2] = {(double)spans[i].begin, (double)spans[i].end};
        cJSON_AddItemToArray(list, cJSON_CreateDoubleArray(pair, 2));
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s || json_failures()) {
        free(s);
        return err_resource(err, "out of memory printing %zu bytes", len);
    }
    puts(s);
    free(s);
    return 0;
}

static int render(const char *template_path, const char *conv_path, Err *err) {
    char *source;
    size_t source_len;
    cJSON *conv = NULL;
    ChatTemplate *t = NULL;
    ChatMessage *msgs = NULL;
    int n = 0;
    if (fs_read_file(template_path, &source, &source_len, err)) return -1;
    int rc = json_read_file(conv_path, &conv, err) ||
             chat_template_parse(source, template_path, &t, err) ||
             read_messages(conv, &msgs, &n, err);
    free(source);
    if (rc == 0) {
        const cJSON *now = cJSON_GetObjectItemCaseSensitive(conv, "now");
        ChatVars vars = {
            .bos_token = string_member(conv, "bos_token"),
            .eos_token = string_member(conv, "eos_token"),
            .add_generation_prompt =
                cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(conv, "add_generation_prompt")),
            .date_string = string_member(conv, "date_string"),
            .now = cJSON_IsNumber(now) ? (time_t)now->valuedouble : 0,
        };
        char *text;
        size_t len;
        ChatSpan *spans;
        int n_spans;
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(conv, "spans"))) {
            rc = chat_template_assistant_spans(t, msgs, n, &vars, &text, &len, &spans, &n_spans,
                                               err);
            if (rc == 0) {
                rc = print_spans(text, len, spans, n_spans, err);
                free(spans);
                free(text);
            }
        } else {
            rc = chat_template_render(t, msgs, n, &vars, &text, &len, err);
            if (rc == 0) {
                fwrite(text, 1, len, stdout);
                free(text);
            }
        }
    }
    free(msgs);
    chat_template_free(t);
    cJSON_Delete(conv);
    return rc ? -1 : 0;
}

int main(int argc, char **argv) {
    json_init();
    if (argc != 3) {
        fputs("usage: chat_render TEMPLATE CONV.json\n", stderr);
        return 2;
    }
    Err err = {0};
    if (render(argv[1], argv[2], &err) == 0) return 0;
    fprintf(stderr, "chat_render: %s\n", err.msg);
    return err_exit_status(&err);
}
