// train_ckpt.h: a run's checkpoint (docs/design.md §6) — everything --resume needs to
// continue bit-for-bit:
//   meta.json              epoch, consumed_samples, step, timestamp, the training spec
//   config.json            model config
//   model.safetensors      weights (fp32 by default: resume is exact; bf16 on request)
//   optimizer.safetensors  AdamW moments / Muon momentum, step count
//   scheduler.json         schedule kind and parameters, steps done
//   sampler.json           epoch, samples consumed in it, seed, shuffle
//   metric.jsonl           AstrAI's rows so far: one per optimizer step, one per epoch end
// A checkpoint written by AstrAI (optimizer.pt and scheduler.pt, pickles, instead of the
// last three .json/.safetensors files) resumes too: weights, epoch, consumed samples and the
// schedule position (the step, from the directory name) continue; the optimizer starts fresh.
#pragma once
#include "comm/comm.h"
#include <stddef.h>

#include "common/error.h"
#include "engine/model.h"
#include "proto/train_spec.h"
#include "train/ckpt_writer.h"

struct Trainer;

// A sharded checkpoint taken and not yet committed: its ranks' files are being written (in the
// background with --async_checkpoint); rank 0 commits it once every rank's are.
typedef struct {
    bool active;
    char name[128]; // epoch_E_step_S
    char tmp[4096]; // rank 0's temporary directory, which every rank writes into
    long step, epoch;
    char *texts[CKPT_N_TEXTS]; // rank 0: rendered when it was taken
} CkptPending;
void train_ckpt_pending_free(CkptPending *p);

// The checkpoint to resume from: param_path if it holds meta.json, else the
// latest checkpoint in ckpt_dir.
int train_ckpt_locate(const TrainSpec *spec, char *out, size_t cap, Err *err);

// Sets the run this process's commits are recorded under in ckpt_dir's ledger (ckpt_set_run):
// the run of the checkpoint resumed from (resume_dir, "" for none) when that is the last its run
// committed, else a new one. Rank 0 reports the checkpoint lookalikes astrai did not commit.
void train_ckpt_choose_run(const TrainSpec *spec, const char *resume_dir, int rank);

// Settles what a writer killed mid-checkpoint left in ckpt_dir (ckpt_remove_stale: `.tmp-*`
// removed, `.old-*` put back), one stderr line per entry. Rank 0 calls it when a run starts,
// before any rank looks for the checkpoint to resume from.
int train_ckpt_clean_dir(const TrainSpec *spec, Err *err);

// A job on several hosts whose ranks read or write ckpt_dir themselves (sharded checkpoints, a
// resume) needs a directory every host sees: rank 0 writes a marker file of a fresh random name
// and content there, every rank reads it back, and when some cannot, every rank fails naming
// them and their hosts (hosts[r]: rank r's). A collective over comm; rank 0 removes the marker.
int train_ckpt_check_shared_dir(const TrainSpec *spec, Comm *comm, const char *const *hosts,
                                Err *err);

// Loads dir/model.safetensors (or its shards, or a Hugging Face directory's weights) into m's
// weights; the config comes from ckpt_model_config (ckpt/model_dir.h).
int train_ckpt_load_weights(Model *m, const char *dir, Err *err);
// DPO/GRPO: the model directory of the frozen reference, into out: param_path, except when
// param_path is the checkpoint resumed (resume_dir), whose meta.json names the reference_path
// of its run (an AstrAI checkpoint names none: its own weights, as AstrAI does; rank 0 warns).
int train_ckpt_reference_dir(const TrainSpec *spec, const char *resume_dir, int rank, char *out,
                             size_t cap, Err *err);
// Creates the model (the pipeline stage of blocks [first_block, end_block); all of them without
// a pipeline) for cfg and loads its tensors of dir/model.safetensors.
int train_ckpt_load_model(Model *m, const ModelConfig *cfg, int first_block, int end_block,
                          const Backend *be, const char *dir, Err *err);

// Writes checkpoint epoch_E_step_S of the trainer's current position into spec->ckpt_dir
// (atomically), every rank taking part; its path goes to path_out. *background: it was only
// started (--async_checkpoint; t->writer must be idle and nothing pending): the full format's on
// rank 0's writer, which commits it; the sharded one on every rank's (t->pending), which
// train_ckpt_finish commits. Else it is committed.
int train_ckpt_save(struct Trainer *t, char *path_out, size_t cap, bool *background, Err *err);
// The pending sharded checkpoint (none: returns 0), every rank taking part once every rank's
// files are written or it must wait for them: waits for this rank's writer, and rank 0 commits it
// when every rank's succeeded. 1 when committed: its path, step and epoch in the out parameters.
int train_ckpt_finish(struct Trainer *t, char *path_out, size_t cap, long *step, long *epoch,
                      Err *err);

// Retention (--checkpoint_keep_last N, --checkpoint_keep_best K), rank 0 after a checkpoint
// committed: of the checkpoints astrai wrote into ckpt_dir, those beyond the newest N and the K of
// lowest val_loss (the validation at their step, from the run's metric rows) are deleted; never
// the one this run resumed from, never one astrai did not write, never another run's (the
// ledger's run: a run resumed from an older checkpoint is a new one). N 0: nothing is deleted.
int train_ckpt_prune(struct Trainer *t, Err *err);

// Restores position, optimizer state and metric rows from checkpoint dir (the
// model weights come from train_ckpt_load_model).
int train_ckpt_load_state(struct Trainer *t, const char *dir, Err *err);
