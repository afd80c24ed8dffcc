// fsutil.h: file helpers with the crash-safety rules of docs/design.md §6.
#pragma once
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common/error.h"

// Opens path read-only after checking (on the open descriptor, so no race) that it is a regular
// file; *st is its stat. Returns the descriptor, or -1 naming the path.
int fs_open_regular(const char *path, struct stat *st, Err *err);

// Reads a whole file into a malloc'd, NUL-terminated buffer (*len excludes the NUL).
int fs_read_file(const char *path, char **data, size_t *len, Err *err);

// Writes data to path atomically: path.tmp.<pid>, fsync, rename, fsync of the directory.
int fs_write_file_atomic(const char *path, const void *data, size_t len, Err *err);
// The same with the file created with mode (under the umask) instead of 0644: a copy no more
// permissive than its source.
int fs_write_file_atomic_mode(const char *path, const void *data, size_t len, mode_t mode,
                              Err *err);

// Writes data to path (plain create/truncate) and fsyncs it; for files inside a
// temporary directory that is itself renamed into place.
int fs_write_file_synced(const char *path, const void *data, size_t len, Err *err);

// mkdir -p with mode 0755.
int fs_mkdir_p(const char *path, Err *err);

// fsync of a directory (so a rename inside it is durable).
int fs_fsync_dir(const char *path, Err *err);

// rm -rf (no symlink following); missing path is not an error.
int fs_remove_tree(const char *path, Err *err);

// 1 if path exists and is a directory / regular file, else 0.
int fs_is_dir(const char *path);
int fs_is_file(const char *path);
