// checkpoint.h: atomic checkpoint directories (docs/design.md §6).
//
//   ckpt_dir/epoch_E_step_S/{meta.json, config.json, model.safetensors, ...}
//
// A checkpoint is written into ckpt_dir/.tmp-<name>-<pid>/, every file and the
// directory are fsynced, then it is renamed to ckpt_dir/<name>. A crash at any
// moment leaves either the previous checkpoint or the new one, never a half
// directory under a checkpoint name; `.tmp-*` leftovers are ignored by
// ckpt_find_latest and removed by ckpt_remove_stale.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

// Creates ckpt_dir (mkdir -p) and a fresh temporary directory for checkpoint
// `name`; its path goes to tmp_path_out. Write the files into it (with
// fs_write_file_synced / st_write), then ckpt_commit or ckpt_abort.
int ckpt_begin(const char *ckpt_dir, const char *name, char *tmp_path_out, size_t cap, Err *err);
// The temporary directory ckpt_begin makes for checkpoint `name` in the process of pid `writer`
// (the ranks of a sharded checkpoint write into rank 0's).
int ckpt_tmp_path(const char *ckpt_dir, const char *name, long writer, char *out, size_t cap,
                  Err *err);

// Fsyncs the files of tmp_path and the directory itself, renames it to
// ckpt_dir/<name> (an existing <name> is moved aside first and removed once
// the new one is durable), and fsyncs ckpt_dir.
int ckpt_commit(const char *ckpt_dir, const char *tmp_path, const char *name, Err *err);

// Removes a temporary directory from ckpt_begin (after a failed write).
int ckpt_abort(const char *tmp_path, Err *err);

// Finds the checkpoint `epoch_E_step_S` with the largest S (then E) that has a
// meta.json; writes its full path to out. Returns 0 when found, 1 when ckpt_dir
// has none (or does not exist), -1 on error.
int ckpt_find_latest(const char *ckpt_dir, char *out, size_t cap, Err *err);

// A checkpoint of a ckpt_dir.
typedef struct {
    char name[256]; // epoch_E_step_S
    long epoch, step;
    bool ours; // written by astrai (it holds a sampler.json), not brought in from elsewhere
} CkptEntry;

// The checkpoints of ckpt_dir (epoch_E_step_S directories with a meta.json), newest first (the
// largest step, then epoch): *out (malloc'ed, *n entries; none when ckpt_dir does not exist).
int ckpt_list(const char *ckpt_dir, CkptEntry **out, int *n, Err *err);

// Deletes checkpoint `name` of ckpt_dir: renamed to a `.tmp-` name first and removed from there,
// so that a crash leaves what ckpt_remove_stale removes, never a half checkpoint under its name.
int ckpt_remove(const char *ckpt_dir, const char *name, Err *err);

// Parses a directory name "epoch_E_step_S"; 0 on success, -1 if it is not one.
int ckpt_parse_name(const char *name, long *epoch, long *step);

// Told one line per entry ckpt_remove_stale settled ("removed DIR/.tmp-... (a checkpoint
// write that did not finish)", "restored DIR/epoch_... from DIR/.old-... (...)").
typedef void (*CkptStaleReport)(void *ctx, const char *what);

// Removes the `.tmp-*` directories a crashed writer left in ckpt_dir (and settles
// the `.old-*` ones of an interrupted replace: put back when nothing took their
// name, else removed), telling report (may be NULL) about each. Call it only when
// no other process writes checkpoints into ckpt_dir (a run at its start).
int ckpt_remove_stale(const char *ckpt_dir, CkptStaleReport report, void *ctx, Err *err);
