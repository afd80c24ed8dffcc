// fsutil.c: file helpers with the crash-safety rules of docs/design.md §6 (write,
// fsync, rename, fsync the directory).
#include "common/fsutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int fs_open_regular(const char *path, struct stat *st, Err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return err_errno(err, errno, "%s: cannot open", path);
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return err_errno(err, e, "%s: cannot stat", path);
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return err_set(err, "%s: not a regular file", path);
    }
    return fd;
}

int fs_read_file(const char *path, char **data, size_t *len, Err *err) {
    *data = NULL;
    if (len) *len = 0;
    struct stat st;
    int fd = fs_open_regular(path, &st, err);
    if (fd < 0) return -1;
    size_t cap = (size_t)st.st_size;
    char *buf = malloc(cap + 1);
    if (!buf) {
        close(fd);
        return err_resource(err, "%s: out of memory for %zu bytes", path, cap);
    }
    size_t got = 0;
    while (got < cap) {
        ssize_t r = read(fd, buf + got, cap - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return err_errno(err, e, "%s: read failed", path);
        }
        if (r == 0) break; // file shrank under us: return what is there
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *data = buf;
    if (len) *len = got;
    return 0;
}

static int write_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

static int write_synced_mode(const char *path, const void *data, size_t len, mode_t mode,
                             Err *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) return err_errno(err, errno, "%s: cannot create", path);
    if (write_all(fd, data, len) != 0 || fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return err_errno(err, e, "%s: write failed", path);
    }
    if (close(fd) != 0) return err_errno(err, errno, "%s: close failed", path);
    return 0;
}

int fs_write_file_synced(const char *path, const void *data, size_t len, Err *err) {
    return write_synced_mode(path, data, len, 0644, err);
}

// Directory part of path ("." when there is none), into out.
static void parent_dir(const char *path, char *out, size_t cap) {
    char copy[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", path);
    snprintf(out, cap, "%s", dirname(copy));
}

int fs_write_file_atomic(const char *path, const void *data, size_t len, Err *err) {
    return fs_write_file_atomic_mode(path, data, len, 0644, err);
}

int fs_write_file_atomic_mode(const char *path, const void *data, size_t len, mode_t mode,
                              Err *err) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return err_set(err, "%s: path too long", path);
    unlink(tmp); // created afresh: open's mode applies only to a new file
    if (write_synced_mode(tmp, data, len, mode, err) != 0) {
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return err_errno(err, e, "%s: cannot rename %s into place", path, tmp);
    }
    char dir[PATH_MAX];
    parent_dir(path, dir, sizeof dir);
    return fs_fsync_dir(dir, err);
}

int fs_mkdir_p(const char *path, Err *err) {
    char buf[PATH_MAX];
    if (path[0] == '\0') return err_set(err, "cannot create a directory with an empty name");
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return err_set(err, "%s: path too long", path);
    // Create every prefix ending before a '/', then the whole path.
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return err_errno(err, errno, "%s: cannot create directory %s", path, buf);
        *p = saved;
        if (saved == '\0') break;
    }
    if (!fs_is_dir(path)) return err_set(err, "%s: exists and is not a directory", path);
    return 0;
}

int fs_fsync_dir(const char *path, Err *err) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return err_errno(err, errno, "%s: cannot open directory", path);
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0) return err_errno(err, e, "%s: fsync of directory failed", path);
    return 0;
}

// Removes the contents of the directory open as dfd (which it closes), then path itself.
static int remove_dir_contents(int dfd, const char *path, Err *err) {
    DIR *d = fdopendir(dfd);
    if (!d) {
        int e = errno;
        close(dfd);
        return err_errno(err, e, "%s: cannot list", path);
    }
    int rc = 0;
    struct dirent *ent;
    while (rc == 0 && (ent = readdir(d)) != NULL) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
        char child[PATH_MAX];
        if (snprintf(child, sizeof child, "%s/%s", path, ent->d_name) >= (int)sizeof child)
            rc = err_set(err, "%s/%s: path too long", path, ent->d_name);
        else
            rc = fs_remove_tree(child, err);
    }
    closedir(d);
    return rc;
}

int fs_remove_tree(const char *path, Err *err) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return 0;
        return err_errno(err, errno, "%s: cannot stat", path);
    }
    if (S_ISDIR(st.st_mode)) {
        // O_NOFOLLOW: a directory swapped for a symlink meanwhile is not followed.
        int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (dfd < 0) return err_errno(err, errno, "%s: cannot open directory", path);
        if (remove_dir_contents(dfd, path, err) != 0) return -1;
        if (rmdir(path) != 0 && errno != ENOENT)
            return err_errno(err, errno, "%s: cannot remove directory", path);
        return 0;
    }
    if (unlink(path) != 0 && errno != ENOENT)
        return err_errno(err, errno, "%s: cannot remove", path);
    return 0;
}

int fs_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int fs_is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}
