// ckpt_writer.h: a checkpoint's files, written at once or in the background (--async_checkpoint,
// docs/training.md "Checkpoints"). In the background training blocks only while the state is
// copied to host memory; a thread writes the files while training goes on: rank 0's whole
// checkpoint, committed by the thread (train_ckpt's atomic layout), or under --ckpt_format
// sharded every rank's own files, which rank 0 commits once every rank's are written. One write
// at most is in flight: a writer holds one checkpoint.
#pragma once
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "common/dtype.h"
#include "common/error.h"
#include "engine/model.h"
#include "engine/optim.h"

// The text files of a checkpoint, rendered when it was taken (the trainer goes on changing).
enum { CKPT_META, CKPT_CONFIG, CKPT_SCHEDULER, CKPT_SAMPLER, CKPT_METRIC, CKPT_N_TEXTS };
extern const char *const CKPT_TEXT_NAMES[CKPT_N_TEXTS];

// What a checkpoint writes: the texts and the model as parts (the stages of a pipeline, or the
// model itself), each a view of fp32 master weights with its optimizer state. A rank's shard of
// a sharded checkpoint (shard_tmp set): its one part as the files model_file and optim_file of
// the temporary directory shard_tmp, and no texts (NULL).
typedef struct {
    const char *ckpt_dir;
    const char *name; // epoch_E_step_S
    DType dtype;      // of the model's file
    char *const *texts;
    int n_parts;
    const ParamView *views;
    const Optimizer *const *opts;
    const char *shard_tmp, *model_file, *optim_file;
} CkptContent;

// Writes checkpoint c synchronously: a whole one committed, or a shard's files written and
// fsynced (the same files whatever the mode).
int ckpt_write(const CkptContent *c, Err *err);
// The texts (CKPT_N_TEXTS, NULL: out of memory when rendered) as dir's files, fsynced.
int ckpt_write_texts(char *const *texts, const char *dir, Err *err);

typedef struct {
    pthread_t thread;
    bool running;         // a write was started and not yet collected (ckpt_writer_collect)
    atomic_bool finished; // the thread is done with it
    long step, epoch;     // of the checkpoint in flight
    char dir[4096];       // its path, once committed
    int rc;
    Err err;
    // the host copy the thread writes from, in host memory of `host` (pinned on GPUs)
    const Backend *host;
    char ckpt_dir[4096], name[128];
    char shard_tmp[4096], model_file[128], optim_file[128]; // a shard's ("": a whole checkpoint)
    DType dtype;
    char *texts[CKPT_N_TEXTS];
    int n_parts;
    ParamView *views;
    Optimizer *opts;
    const Optimizer **opt_ptrs;
} CkptWriter;

// Copies c (texts, weights and optimizer state, from the backend to host memory) and starts
// writing it in the background. The writer must be idle (collected). On failure nothing runs.
int ckpt_writer_start(CkptWriter *w, const CkptContent *c, long step, long epoch, Err *err);
// Whether a write was started and is done (collect it); never blocks. *failed: whether it
// failed (collect says why).
bool ckpt_writer_done(const CkptWriter *w, bool *failed);
// Waits for the write in flight (none: returns 0 at once) and frees its copy: 0 and its
// directory in w->dir when committed (a shard: written), -1 with err (naming the step and path)
// when it failed.
int ckpt_writer_collect(CkptWriter *w, Err *err);
void ckpt_writer_free(CkptWriter *w);
