// checkpoint.h: atomic checkpoint directories (docs/design.md §6).
//
//   ckpt_dir/epoch_E_step_S/{meta.json, config.json, model.safetensors, ...}
//
// A checkpoint is written into ckpt_dir/.tmp-<name>-<pid>/ (marked by a .astrai-tmp file inside
// it until the commit), every file and the
// directory are fsynced, then it is renamed to ckpt_dir/<name>. A crash at any
// moment leaves either the previous checkpoint or the new one, never a half
// directory under a checkpoint name; `.tmp-*` leftovers are ignored by
// ckpt_find_latest and removed by ckpt_remove_stale.
//
// Each commit (and each removal) is appended to ckpt_dir/.astrai-ledger first: which
// checkpoints of ckpt_dir astrai wrote, in commit order, and by which run. A directory named
// like a checkpoint that the ledger does not hold (a user's copy, another run's directory, a
// symlink) is foreign: never "latest" while a ledger exists, never deleted.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

#define CKPT_LEDGER ".astrai-ledger"

// The run this process's commits are recorded under (a short token without spaces; "-" until
// set). One run per process: astrai-train sets it once before its first checkpoint.
void ckpt_set_run(const char *run);
const char *ckpt_current_run(void);

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

// Finds the checkpoint to resume from: the last one the ledger says astrai committed (and did
// not remove) that is still there with a meta.json; without a ledger (a ckpt_dir of AstrAI's or
// of an older astrai) the one with the largest S (then E). Writes its full path to out. Returns
// 0 when found, 1 when ckpt_dir has none (or does not exist), -1 on error.
int ckpt_find_latest(const char *ckpt_dir, char *out, size_t cap, Err *err);

// A checkpoint of a ckpt_dir.
typedef struct {
    char name[256]; // epoch_E_step_S
    long epoch, step;
    bool ours;    // committed by astrai into this ckpt_dir (the ledger's live entry)
    long seq;     // ours: its line in the ledger (larger: committed later)
    char run[64]; // ours: the run that committed it
} CkptEntry;

// The checkpoints of ckpt_dir (epoch_E_step_S directories, not symlinks, with a meta.json),
// newest first: astrai's own by commit, then the others by the largest step, then epoch: *out
// (malloc'ed, *n entries; none when ckpt_dir does not exist). *has_ledger: ckpt_dir has one.
int ckpt_list(const char *ckpt_dir, CkptEntry **out, int *n, bool *has_ledger, Err *err);

// Deletes checkpoint `name` of ckpt_dir (a real directory, never a symlink; the ledger records
// the removal): renamed to a marked `.tmp-` name first and removed from there,
// so that a crash leaves what ckpt_remove_stale removes, never a half checkpoint under its name.
int ckpt_remove(const char *ckpt_dir, const char *name, Err *err);

// Parses a directory name "epoch_E_step_S"; 0 on success, -1 if it is not one.
int ckpt_parse_name(const char *name, long *epoch, long *step);

// Told one line per entry ckpt_remove_stale settled ("removed DIR/.tmp-... (a checkpoint
// write that did not finish)", "restored DIR/epoch_... from DIR/.old-... (...)").
typedef void (*CkptStaleReport)(void *ctx, const char *what);

// Removes the `.tmp-*` directories a crashed writer left in ckpt_dir (only astrai's: the name
// `.tmp-epoch_E_step_S-PID` and the marker inside) (and settles
// the `.old-*` ones of an interrupted replace: put back when nothing took their
// name, else removed), telling report (may be NULL) about each. Call it only when
// no other process writes checkpoints into ckpt_dir (a run at its start).
int ckpt_remove_stale(const char *ckpt_dir, CkptStaleReport report, void *ctx, Err *err);
