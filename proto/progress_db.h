// progress_db.h: progress.db, the contract between astrai-train's rank 0 (its only writer,
// train/progress.c) and its readers (astraid's daemon/progress_reader.c and
// daemon/curve.c). Its file name, its schema and every statement either side runs are here
// and nowhere else (docs/design.md §6). Readers open it read-only under WAL and never block
// the writer. A table added later must be optional to readers: a database written by an older
// astrai-train lacks it (validation came after steps; curve.c checks).
#pragma once

#define PROGRESS_DB_FILE "progress.db" // in the run directory (or ckpt_dir, run alone)

// One row per optimizer step, per checkpoint, per validation; step_metrics holds the named
// extra numbers of a step (the DPO/GRPO terms, a mixture of experts' expert_load_max and
// expert_load_min); run holds keys of the whole run ('total_steps'); expert_load holds, per step
// of a mixture-of-experts model, the (token, choice) pairs each routed expert of each layer
// received, summed over the step's micro-batches and ranks; samples holds what the model wrote for
// each of sample_prompts at a step (train/samples.h): idx the prompt's line among them, prompt
// its text (a conversation rendered), completion the text generated, tokens how many.
#define PROGRESS_DB_SCHEMA                                                                         \
    "PRAGMA journal_mode=WAL;"                                                                     \
    "PRAGMA synchronous=NORMAL;"                                                                   \
    "CREATE TABLE IF NOT EXISTS steps(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"           \
    " consumed_samples INTEGER NOT NULL, loss REAL, lr REAL, grad_norm REAL,"                      \
    " tokens_per_s REAL, wall_time REAL NOT NULL);"                                                \
    "CREATE TABLE IF NOT EXISTS checkpoints(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"     \
    " path TEXT NOT NULL, wall_time REAL NOT NULL);"                                               \
    "CREATE TABLE IF NOT EXISTS validation(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"      \
    " consumed_samples INTEGER NOT NULL, val_loss REAL, wall_time REAL NOT NULL);"                 \
    "CREATE TABLE IF NOT EXISTS step_metrics(step INTEGER NOT NULL, name TEXT NOT NULL,"           \
    " value REAL, PRIMARY KEY(step, name));"                                                       \
    "CREATE TABLE IF NOT EXISTS run(key TEXT PRIMARY KEY, value);"                                 \
    "CREATE TABLE IF NOT EXISTS expert_load(step INTEGER NOT NULL, layer INTEGER NOT NULL,"        \
    " expert INTEGER NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY(step, layer, expert));"        \
    "CREATE TABLE IF NOT EXISTS samples(step INTEGER NOT NULL, idx INTEGER NOT NULL,"              \
    " prompt TEXT NOT NULL, completion TEXT NOT NULL, tokens INTEGER NOT NULL,"                    \
    " wall_time REAL NOT NULL, PRIMARY KEY(step, idx));"

// ---------------------------------------------------------------- the writer's statements

// A resumed run forgets the rows after its checkpoint's step (%ld: the step, six times, then
// total_steps), so the curve is the run's own.
#define PROGRESS_DB_FORGET_AFTER                                                                   \
    "BEGIN IMMEDIATE; DELETE FROM steps WHERE step > %ld;"                                         \
    " DELETE FROM checkpoints WHERE step > %ld; DELETE FROM validation WHERE step > %ld;"          \
    " DELETE FROM step_metrics WHERE step > %ld; DELETE FROM expert_load WHERE step > %ld;"        \
    " DELETE FROM samples WHERE step > %ld;"                                                       \
    " INSERT OR REPLACE INTO run(key, value) VALUES('total_steps', %ld); COMMIT;"
#define PROGRESS_DB_INSERT_STEP                                                                    \
    "INSERT OR REPLACE INTO steps(step, epoch, consumed_samples, loss, lr, grad_norm,"             \
    " tokens_per_s, wall_time) VALUES(?1,?2,?3,?4,?5,?6,?7,?8)"
#define PROGRESS_DB_INSERT_CHECKPOINT                                                              \
    "INSERT OR REPLACE INTO checkpoints(step, epoch, path, wall_time) VALUES(?1,?2,?3,?4)"
// A checkpoint the retention deleted (--checkpoint_keep_last).
#define PROGRESS_DB_DELETE_CHECKPOINT "DELETE FROM checkpoints WHERE step = ?1"
#define PROGRESS_DB_INSERT_VALIDATION                                                              \
    "INSERT OR REPLACE INTO validation(step, epoch, consumed_samples, val_loss, wall_time)"        \
    " VALUES(?1,?2,?3,?4,?5)"
// The trainer's phase between optimizer steps (run keys 'phase' and 'phase_since', unix seconds):
// "validation" or "checkpoint" while rank 0 is in one, "" once it is over. astraid's watchdog
// (daemon/watchdog.c) gives a phase longer than a step; a database without the keys (an older
// astrai-train) has no phase.
#define PROGRESS_DB_SET_PHASE                                                                      \
    "INSERT OR REPLACE INTO run(key, value) VALUES('phase', ?1), ('phase_since', ?2)"
#define PROGRESS_DB_INSERT_EXPERT_LOAD                                                             \
    "INSERT OR REPLACE INTO expert_load(step, layer, expert, tokens) VALUES(?1,?2,?3,?4)"
// One step's samples go in one transaction (train/progress.c progress_add_samples).
#define PROGRESS_DB_INSERT_SAMPLE                                                                  \
    "INSERT OR REPLACE INTO samples(step, idx, prompt, completion, tokens, wall_time)"             \
    " VALUES(?1,?2,?3,?4,?5,?6)"
#define PROGRESS_DB_INSERT_METRIC                                                                  \
    "INSERT OR REPLACE INTO step_metrics(step, name, value) VALUES(?1,?2,?3)"

// ---------------------------------------------------------------- the readers' statements

// The ?1 newest steps, newest first: columns step, epoch, loss, lr, grad_norm, tokens_per_s,
// wall_time (progress_reader.c: the latest values and the pace for the ETA).
#define PROGRESS_DB_LATEST_STEPS                                                                   \
    "SELECT step, epoch, loss, lr, grad_norm, tokens_per_s, wall_time FROM steps"                  \
    " ORDER BY step DESC LIMIT ?1"
#define PROGRESS_DB_LAST_CHECKPOINT "SELECT path FROM checkpoints ORDER BY step DESC LIMIT 1"
#define PROGRESS_DB_LAST_VALIDATION "SELECT val_loss FROM validation ORDER BY step DESC LIMIT 1"
// Loss scaling (--loss_scale): the newest step's scale, and how many steps were skipped.
#define PROGRESS_DB_LOSS_SCALE                                                                     \
    "SELECT (SELECT value FROM step_metrics WHERE name = 'loss_scale' ORDER BY step DESC LIMIT "   \
    "1),"                                                                                          \
    " (SELECT COUNT(*) FROM step_metrics WHERE name = 'skipped' AND value > 0)"
// A mixture of experts' load (train/trainer.c writes both names in the step's row, so the newest
// of each is the same step): the most and least loaded routed expert over its layer's mean.
#define PROGRESS_DB_EXPERT_LOAD                                                                    \
    "SELECT (SELECT value FROM step_metrics WHERE name = 'expert_load_max' ORDER BY step DESC"     \
    " LIMIT 1),"                                                                                   \
    " (SELECT value FROM step_metrics WHERE name = 'expert_load_min' ORDER BY step DESC LIMIT 1)"
// The online strategies' rollout statistics of the newest step that has them: reward_mean,
// reward_std, response_len, equal_reward_groups (NULLs without).
#define PROGRESS_DB_ROLLOUT                                                                        \
    "SELECT (SELECT value FROM step_metrics WHERE name = 'reward_mean' AND step = n.s),"           \
    " (SELECT value FROM step_metrics WHERE name = 'reward_std' AND step = n.s),"                  \
    " (SELECT value FROM step_metrics WHERE name = 'response_len' AND step = n.s),"                \
    " (SELECT value FROM step_metrics WHERE name = 'equal_reward_groups' AND step = n.s)"          \
    " FROM (SELECT MAX(step) AS s FROM step_metrics WHERE name = 'response_len') n"
// The numbers beyond the steps columns (step_metrics: loss_scale, skipped, the DPO/GRPO ones) of
// the steps in (?1, ?2], in step order.
#define PROGRESS_DB_CURVE_METRICS                                                                  \
    "SELECT step, name, value FROM step_metrics WHERE step > ?1 AND step <= ?2 ORDER BY step"
// The phase and since when (NULLs without one): columns phase, phase_since.
#define PROGRESS_DB_PHASE                                                                          \
    "SELECT (SELECT value FROM run WHERE key = 'phase'),"                                          \
    " (SELECT CAST(value AS REAL) FROM run WHERE key = 'phase_since')"
// Samples (daemon/samples.c), in (step, idx) order: ?2 true: those of every step after ?3; else
// those of step ?1, NULL: of the newest step that has samples. Columns step, idx, prompt,
// completion, tokens.
#define PROGRESS_DB_SAMPLES                                                                        \
    "SELECT step, idx, prompt, completion, tokens FROM samples WHERE (?2 AND step > ?3) OR"        \
    " (NOT ?2 AND step = COALESCE(?1, (SELECT MAX(step) FROM samples))) ORDER BY step, idx"
#define PROGRESS_DB_TOTAL_STEPS "SELECT CAST(value AS INTEGER) FROM run WHERE key='total_steps'"

// The curve (curve.c): steps after ?1, at most ?2 of them, in order; columns step, loss, lr,
// grad_norm, tokens_per_s, wall_time, then (with validation) the validation row's step and
// val_loss, NULL where that step has none.
#define PROGRESS_DB_CURVE_WITH_VALIDATION                                                          \
    "SELECT s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s, s.wall_time, v.step, v.val_loss"    \
    " FROM steps s LEFT JOIN validation v ON v.step = s.step"                                      \
    " WHERE s.step > ?1 ORDER BY s.step LIMIT ?2"
#define PROGRESS_DB_CURVE_STEPS_ONLY                                                               \
    "SELECT step, loss, lr, grad_norm, tokens_per_s, wall_time FROM steps"                         \
    " WHERE step > ?1 ORDER BY step LIMIT ?2"
