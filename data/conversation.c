// conversation.c: conversation records and their chat template (data/conversation.h).
#include "data/conversation.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fsutil.h"

static int check_message(const cJSON *m, int i, Err *err) {
    if (!cJSON_IsObject(m)) return err_set(err, "\"messages\"[%d] is not an object", i);
    for (const cJSON *e = m->child; e; e = e->next)
        if (strcmp(e->string, "role") != 0 && strcmp(e->string, "content") != 0)
            return err_set(err,
                           "\"messages\"[%d]: unknown key \"%s\" (a message has \"role\" and "
                           "\"content\")",
                           i, e->string);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (!cJSON_IsString(role))
        return err_set(err, "\"messages\"[%d]: \"role\" is missing or not a string", i);
    if (strcmp(role->valuestring, "system") != 0 && strcmp(role->valuestring, "user") != 0 &&
        strcmp(role->valuestring, "assistant") != 0)
        return err_set(err, "\"messages\"[%d]: unknown role \"%s\" (system, user or assistant)", i,
                       role->valuestring);
    if (!cJSON_IsString(content))
        return err_set(err, "\"messages\"[%d]: \"content\" is missing or not a string", i);
    return 0;
}

int conversation_messages(const cJSON *list, ChatMessage **msgs, int *n, Err *err) {
    if (!cJSON_IsArray(list) || !list->child)
        return err_set(err, "\"messages\" must be a non-empty list of {\"role\", \"content\"}");
    *n = cJSON_GetArraySize(list);
    if (!(*msgs = malloc((size_t)*n * sizeof **msgs)))
        return err_resource(err, "out of memory for %d messages", *n);
    int i = 0;
    for (const cJSON *m = list->child; m; m = m->next, i++) {
        if (check_message(m, i, err) != 0) {
            free(*msgs);
            *msgs = NULL;
            return -1;
        }
        (*msgs)[i] = (ChatMessage){cJSON_GetObjectItemCaseSensitive(m, "role")->valuestring,
                                   cJSON_GetObjectItemCaseSensitive(m, "content")->valuestring};
    }
    return 0;
}

int conversation_template(const Tokenizer *tok, const char *file, ChatTemplate **out, Err *err) {
    const char *source = file ? NULL : tokenizer_config_string(tok, "chat_template");
    char *text = NULL;
    size_t len;
    if (file && fs_read_file(file, &text, &len, err) != 0)
        return err_prefix(err, "--chat_template");
    if (text && strlen(text) != len) {
        free(text);
        return err_set(err, "--chat_template %s: holds a NUL byte", file);
    }
    if (!file && !source)
        return err_set(err, "a conversation (\"messages\") needs a chat template: the tokenizer "
                            "has no tokenizer_config.json \"chat_template\" string; give "
                            "--chat_template FILE");
    int rc = chat_template_parse(file ? text : source,
                                 file ? file : "tokenizer_config.json \"chat_template\"", out, err);
    free(text);
    return rc;
}

int conversation_vars(const Tokenizer *tok, ChatVars *vars, Err *err) {
    *vars = (ChatVars){.bos_token = tokenizer_config_string(tok, "bos_token"),
                       .eos_token = tokenizer_config_string(tok, "eos_token"),
                       .pad_token = tokenizer_config_string(tok, "pad_token"),
                       .unk_token = tokenizer_config_string(tok, "unk_token"),
                       .now = time(NULL)};
    const char *epoch = getenv("SOURCE_DATE_EPOCH");
    if (!epoch) return 0;
    char *end;
    errno = 0;
    long long v = strtoll(epoch, &end, 10);
    if (errno || end == epoch || *end || v < 0)
        return err_set(err, "SOURCE_DATE_EPOCH: '%s' is not a number of seconds", epoch);
    vars->now = (time_t)v;
    return 0;
}
