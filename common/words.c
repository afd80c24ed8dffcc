// words.c: a command's words as sh would split them (common/words.h).
#include "common/words.h"

#include <stdlib.h>
#include <string.h>

char *words_split(const char *flag, const char *s, char **words, int max, int *n, Err *err) {
    const char *in = s;
    char *copy = strdup(s), *out = copy, quote = 0;
    if (!copy) return err_resource(err, "%s: out of memory", flag), NULL;
    for (*n = 0;; *out++ = 0) {
        while (*in == ' ' || *in == '\t')
            in++;
        if (!*in) return copy;
        if (*n == max) break;
        words[(*n)++] = out;
        for (; *in && (quote || (*in != ' ' && *in != '\t')); in++) {
            if (*in == quote)
                quote = 0;
            else if (!quote && (*in == '\'' || *in == '"'))
                quote = *in;
            else if (*in == '\\' && !in[1])
                break; // nothing to escape
            else if (*in == '\\' && (!quote || (quote == '"' && strchr("\\\"$`", in[1]))))
                *out++ = *++in;
            else
                *out++ = *in;
        }
        if (quote || *in == '\\') break;
    }
    if (quote)
        err_set(err, "%s: unbalanced %c in '%s'", flag, quote, s);
    else if (*in == '\\')
        err_set(err, "%s: a trailing \\ in '%s'", flag, s);
    else
        err_set(err, "%s: more than %d words in '%s'", flag, max, s);
    free(copy);
    return NULL;
}
