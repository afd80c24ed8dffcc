// words.h: a command line given as one string (astraid's notify-command and slurm-sbatch-args,
// astrai-train's reward_command) split into words as sh would split them, without a shell.
#pragma once
#include "common/error.h"

// s split into words as sh would (blanks separate; '...' literal; "..." where \ escapes only
// \ " $ `; \ outside quotes escapes any character), without expanding $, ` or globs. At most
// max words in words[], their number in *n; they point into the returned copy (free it); NULL
// on failure (unbalanced quotes, a trailing \, more than max words, memory). err names `flag`
// and s.
char *words_split(const char *flag, const char *s, char **words, int max, int *n, Err *err);
