#!/usr/bin/env python3
"""The fault matrix: training jobs under the faults an unlucky operator meets, each followed
by the checks that nothing was lost, left behind or mixed up.

Injections (one per case; kind, configuration, rank and moment drawn from a seeded generator
and logged):
  kill9_astraid       kill -9 of astraid while its job trains; astraid started again
  kill9_rank          kill -9 of one rank of an astraid job (astraid restarts the run)
  sigterm_rank        SIGTERM from outside to one rank of an astraid job
  kill9_launcher      kill -9 of `astrai-train --nprocs 2` (the local launcher); rerun --resume
  kill9_rank_local    kill -9 of one rank under the local launcher; rerun --resume
  sigterm_rank_local  SIGTERM from outside to one rank under the local launcher; rerun --resume
  sigterm_launcher    SIGTERM to the local launcher; rerun --resume
  enospc_ckpt         ckpt_dir on a small tmpfs that fills up; enlarged, the job resumed
  enospc_state        astraid's state dir on a full tmpfs while jobs are submitted
  readonly_ckpt       ckpt_dir remounted read-only mid-run; rw again, the job resumed
  readonly_state      the state dir remounted read-only mid-run; rw again, astraid restarted
  db_deleted / db_emptied / db_corrupt
                      astraid.db removed / truncated / overwritten while astraid was down
A moment is a random time into the run, or the instant a checkpoint is being written (a
`.tmp-*` directory exists in ckpt_dir). The tmpfs kinds need root and mount(2); without them
they are skipped, with the reason.

Checked after each case: every `epoch_*_step_*` checkpoint complete (all its files, JSON that
parses, safetensors whose header matches their size); every checkpoint seen complete before the
injection still there; no `.tmp-*`/`.old-*` leftover once the job ended; no astrai-train
process of the case left; no /dev/shm entry of its processes left; the JOB that astraictl
shows agrees with the disk and the database; and the final model files byte-identical to
an undisturbed run of the same deterministic job (tiny model, fixed seed, shuffle on).

  fault_matrix.py --short            the CI subset (one case per main kind, <= 3 minutes)
  fault_matrix.py --count 120        120 random cases (the long mode)
  fault_matrix.py --seed S --case I  case I of seed S again (each failure prints this line)
Needs ASTRAI_BUILD (the build directory); exits 1 when a check failed."""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import daemon_util as du  # noqa: E402
import train_util as tu  # noqa: E402

SLOW = 4 if os.environ.get("ASTRAI_SANITIZED") in ("1", "ON", "TRUE", "true") else 1
CKPT_TEXTS = ("meta.json", "config.json", "scheduler.json", "sampler.json", "metric.jsonl")
CKPT_NAME = re.compile(r"epoch_(\d+)_step_(\d+)")
FINAL = ("completed", "failed", "cancelled")

# Configurations of the deterministic job: (parallel_mode, nprocs, pp_size, ckpt_format); pp: a
# pipeline of two stages (docs/design.md §13); sharded: each rank writes its own files (§14).
CONFIGS = {"none": ("none", 1, 1, "full"), "ddp": ("ddp", 2, 1, "full"),
           "fsdp": ("fsdp", 2, 1, "full"), "pp": ("none", 2, 2, "full"),
           "sharded": ("fsdp", 2, 1, "sharded")}
DAEMON_KINDS = ("kill9_astraid", "kill9_rank", "sigterm_rank", "enospc_ckpt", "readonly_ckpt",
                "enospc_state", "readonly_state", "db_deleted", "db_emptied", "db_corrupt")
LOCAL_KINDS = ("kill9_launcher", "kill9_rank_local", "sigterm_rank_local", "sigterm_launcher")
MOUNT_KINDS = ("enospc_ckpt", "readonly_ckpt", "enospc_state", "readonly_state")
SHORT = [("kill9_astraid", "ddp"), ("kill9_rank", "ddp"), ("kill9_rank", "pp"),
         ("kill9_rank", "sharded"), ("enospc_ckpt", "sharded"),
         ("sigterm_rank", "none"),
         ("kill9_launcher", "ddp"), ("enospc_ckpt", "none"), ("db_deleted", "none")]


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- what is on disk

def safetensors_problem(path):
    """None when the file's header parses and its tensors fill the data exactly."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        return "shorter than its header length"
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        return f"header is not JSON ({e})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if max(ends, default=0) != len(data) - 8 - n:
        return f"tensors end at {max(ends, default=0)}, data is {len(data) - 8 - n} bytes"
    return None


def tensor_files(path, stem):
    """The files of a checkpoint that hold its model or optimizer tensors: STEM.safetensors, or
    the shards its index names (docs/design.md §14)."""
    if os.path.isfile(os.path.join(path, f"{stem}.safetensors")):
        return [f"{stem}.safetensors"]
    with open(os.path.join(path, f"{stem}.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def checkpoint_problem(path):
    """None when the checkpoint directory is complete and readable."""
    try:
        names = tensor_files(path, "model") + tensor_files(path, "optimizer")
    except (OSError, ValueError, KeyError) as e:
        return f"no tensor files: {e}"
    for name in CKPT_TEXTS + tuple(names):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return f"{name} missing"
        try:
            if name.endswith(".safetensors"):
                why = safetensors_problem(p)
                if why:
                    return f"{name}: {why}"
            elif name.endswith(".jsonl"):
                with open(p) as f:
                    for line in f:
                        if line.strip():
                            json.loads(line)
            else:
                with open(p) as f:
                    json.load(f)
        except (OSError, ValueError) as e:
            return f"{name}: {e}"
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    step = int(CKPT_NAME.fullmatch(os.path.basename(path)).group(2))
    if meta.get("step", step) != step:
        return f"meta.json says step {meta.get('step')}"
    return None


def scan_ckpt_dir(ckpt_dir):
    """(complete: {name: model_digest}, problems, leftovers)."""
    complete, problems, leftovers = {}, [], []
    if not os.path.isdir(ckpt_dir):
        return complete, problems, leftovers
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if CKPT_NAME.fullmatch(name):
            why = checkpoint_problem(path)
            if why:
                problems.append(f"half checkpoint {path}: {why}")
            else:
                complete[name] = model_digest(path)
        elif name.startswith((".tmp-", ".old-")):
            leftovers.append(path)
    return complete, problems, leftovers


def latest(complete):
    return max(complete, key=lambda n: tuple(int(x) for x in CKPT_NAME.fullmatch(n).groups()[::-1]),
               default=None)


def model_digest(path):
    """sha256 of a checkpoint's model tensor files, in order."""
    h = hashlib.sha256()
    for name in tensor_files(path, "model"):
        with open(os.path.join(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


# ---------------------------------------------------------------- processes of a case

def proc_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def proc_env(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def proc_status(pid):
    """'ppid P, state S, N s old' of a live process, for the report of an orphan."""
    try:
        with open(f"/proc/{pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return "gone"
    return f"ppid {st['PPid'].strip()}, state {st['State'].strip()}, {age:.0f} s old"


def train_procs(root):
    """{pid: RANK or None (a launcher)} of the live astrai-train processes of this case."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        argv = proc_cmdline(int(d))
        if not argv or os.path.basename(argv[0]) != b"astrai-train":
            continue
        if not any(root.encode() in a for a in argv) or not du.pid_alive(int(d)):
            continue
        rank = proc_env(int(d)).get("RANK") if proc_env(int(d)).get("ASTRAI_LAUNCHED") else None
        out[int(d)] = rank
    return out


class Watcher(threading.Thread):
    """Records every astrai-train process of the case (for orphans and /dev/shm leftovers)."""

    def __init__(self, root):
        super().__init__(daemon=True)
        self.root, self.seen, self.stopping = root, set(), False

    def run(self):
        while not self.stopping:
            self.seen.update(train_procs(self.root))
            time.sleep(0.02)

    def stop(self):
        self.stopping = True
        self.join()


def shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def own_shm(entries, pids):
    """The /dev/shm entries that belong to processes in pids: (comm/shm segments, named after
    their launcher /astrai-PID-..., and libomp's registration files __KMP_REGISTERED_LIB_PID_*).
    libomp, the OpenMP runtime of clang builds (the sanitizer build), registers every process
    there and removes the file at exit; a killed process leaves it, whatever the program does
    (gcc builds use libgomp, which has none)."""
    segments, kmp = [], []
    for e in sorted(entries):
        m = re.match(r"astrai-(\d+)-", e)
        if m and int(m.group(1)) in pids:
            segments.append(e)
        m = re.match(r"__KMP_REGISTERED_LIB_(\d+)_", e)
        if m and int(m.group(1)) in pids:
            kmp.append(e)
    return segments, kmp


# ---------------------------------------------------------------- mounts

def mount_tmpfs(path, size_kib):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", path],
                   check=True, capture_output=True)


def remount(path, opts, timeout=10):
    """mount -o remount; retried while it is busy (read-only needs no file open for writing)."""
    deadline = time.time() + timeout
    while True:
        proc = subprocess.run(["mount", "-o", f"remount,{opts}", path], capture_output=True)
        if proc.returncode == 0:
            return
        if time.time() > deadline:
            raise RuntimeError(f"mount -o remount,{opts} {path}: {proc.stderr.decode().strip()}")
        time.sleep(0.002)


def umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def mount_permitted(base):
    """None when tmpfs mounts work here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = os.path.join(base, "mount-probe")
    try:
        mount_tmpfs(probe, 64)
    except (subprocess.CalledProcessError, OSError) as e:
        err = getattr(e, "stderr", b"") or b""
        return f"mount -t tmpfs failed: {err.decode(errors='replace').strip() or e}"
    umount(probe)
    return None


# ---------------------------------------------------------------- the deterministic job

class Setup:
    """The tiny model and data shared by every case, and the undisturbed runs' results."""

    def __init__(self, base, windows):
        self.base = base
        self.model, self.data = du.make_setup(base, windows)
        self.refs = {}

    def flags(self, config, seed=7):
        mode, nprocs, pp, fmt = CONFIGS[config]
        return du.spec(self.model, self.data, ckpt_interval=1, parallel_mode=mode,
                       nprocs=nprocs, pp_size=pp, ckpt_format=fmt, random_seed=seed)

    def reference(self, config, seed=7):
        """(final checkpoint name, model_digest of it, seconds it trained)."""
        key = (config, seed)
        if key not in self.refs:
            ckpt = os.path.join(self.base, f"ref-{config}-{seed}")
            args = dict(self.flags(config, seed), ckpt_dir=ckpt)
            t0 = time.time()
            tu.train(args)
            complete, problems, _ = scan_ckpt_dir(ckpt)
            assert not problems, problems
            name = latest(complete)
            self.refs[key] = (name, complete[name], time.time() - t0)
            shutil.rmtree(ckpt)
            log(f"reference {config} seed {seed}: {name} in {self.refs[key][2]:.1f} s")
        return self.refs[key]


# ---------------------------------------------------------------- one case

class Case:
    def __init__(self, setup, base, index, seed, kind, config):
        self.setup, self.index, self.seed, self.kind, self.config = setup, index, seed, kind, config
        self.rng = random.Random(seed)
        self.root = tempfile.mkdtemp(prefix=f"case{index}-", dir=base)
        self.failures, self.notes, self.mounts = [], [], []
        self.daemon = None
        self.launcher_pids, self.daemon_pids = set(), set()
        self.before = {}  # ckpt_dir -> checkpoint names at the injection
        self.shm_before = shm_entries()
        self.watcher = Watcher(self.root)
        self.moment = self.rng.choice(["time", "ckpt"])
        self.fraction = self.rng.uniform(0.05, 0.95)

    def fail(self, what):
        self.failures.append(what)

    def note(self, what):
        self.notes.append(what)

    def mount(self, path, size_kib):
        mount_tmpfs(path, size_kib)
        self.mounts.append(path)

    # ------------------------------------------------ moments
    def wait_moment(self, ckpt_dir, config):
        """Waits for the drawn moment: once checkpoint k is written (k drawn among the run's
        steps), a random part of a step later ("time") or the instant the next checkpoint is
        being written ("ckpt"). Notes the step it came at and whether a write was in flight."""
        name, _, seconds = self.setup.reference(config)
        total = int(CKPT_NAME.fullmatch(name).group(2))
        k = max(1, min(total - 1, int(self.fraction * total)))
        deadline = time.time() + 120 * SLOW
        step, inflight = 0, False
        while time.time() < deadline:
            names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
            step = max((int(m.group(2)) for m in map(CKPT_NAME.fullmatch, names) if m), default=0)
            inflight = any(n.startswith(".tmp-") for n in names)
            if step >= total:
                break
            if step >= k and self.moment == "time":
                time.sleep(self.rng.uniform(0, seconds / total))
                break
            if step >= k and inflight:
                break
            time.sleep(0.001)
        self.snapshot(ckpt_dir)
        self.note(f"at step {step}/{total}{' mid-checkpoint' if inflight else ''}")
        if step >= total:
            self.note("MISSED: the run had ended")

    def snapshot(self, ckpt_dir):
        """The checkpoint names in ckpt_dir now (a rename makes a name complete: they must all
        be there, complete, after the case)."""
        names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
        self.before[ckpt_dir] = [n for n in names if CKPT_NAME.fullmatch(n)]

    # ------------------------------------------------ astraid
    def start_daemon(self, expect_ok=True):
        """astraid on the case's socket and state dir, 2 CPU slots; False when it did not
        come up (exited, or no answer) and expect_ok is off."""
        self.daemon = du.Daemon(self.root, devices="cpu:2", max_restarts=8)
        self.daemon.start(wait=False)
        self.daemon_pids.add(self.daemon.proc.pid)
        try:
            self.daemon.wait_ready(60 * SLOW)
        except AssertionError:
            if expect_ok:
                raise
            return False
        return True

    def client(self):
        return du.Client(self.daemon.socket, timeout=30 * SLOW)

    def last_log_line(self):
        lines = self.daemon.logs().splitlines()
        return lines[-1] if lines else ""

    def submit(self, c, config, seed=7, **extra):
        spec = dict(self.setup.flags(config, seed), **extra)
        return c.call("submit", spec)["job"]

    def wait_state(self, jid, states, timeout, until=None):
        """The job's JOB once its state is one of `states` (or `until(JOB)` holds); the last
        one seen at the timeout."""
        deadline = time.time() + timeout * SLOW
        last = None
        while time.time() < deadline:
            try:
                c = self.client()
                last = c.call("status", {"job": jid})
                c.close()
            except (OSError, ConnectionError, du.RpcError) as e:
                last = {"state": f"unreachable ({e})"}
            if last["state"] in states or until and until(last):
                return last
            time.sleep(0.1)
        return last

    def wait_running(self, jid):
        return self.wait_state(jid, ["running"] + list(FINAL), 60)

    def rank_pid(self, rank, timeout=30):
        deadline = time.time() + timeout * SLOW
        while time.time() < deadline:
            for pid, r in train_procs(self.root).items():
                if r == str(rank):
                    return pid
            time.sleep(0.01)
        return None

    def stop_daemon(self):
        if self.daemon and self.daemon.proc and self.daemon.proc.poll() is None:
            rc = self.daemon.stop(signal.SIGTERM, timeout=120 * SLOW)
            if rc != 0:
                self.fail(f"astraid exited {rc} on SIGTERM")

    def finish_job(self, jid, config, seed=7, resume_failed=False):
        """Waits for the job to end; resumes it once when failed (after a fault that
        no restart could get past); checks it completed with the reference's weights."""
        st = self.wait_state(jid, FINAL, 240)
        if st["state"] == "failed" and resume_failed:
            self.note(f"failed as expected: {st.get('error')!r:.160}")
            c = self.client()
            c.call("resume", {"job": jid})
            c.close()
            st = self.wait_state(jid, FINAL, 240)
        if st["state"] != "completed":
            self.fail(f"job {jid} ended {st['state']}: {st.get('error')!r:.300}")
            return st
        self.check_final(st["spec"]["ckpt_dir"], config, seed,
                         f"job {jid} at step {st['step']}/{st['total_steps']}")
        self.check_status(jid)
        return st

    def check_status(self, jid):
        """astraictl's JOB agrees with the disk and with astraid.db."""
        proc = subprocess.run([tu.binary("astraictl"), "--socket", self.daemon.socket, "--json",
                               "status", str(jid)], capture_output=True, text=True,
                              timeout=60 * SLOW)
        if proc.returncode != 0:
            self.fail(f"astraictl status {jid}: exit {proc.returncode}: {proc.stderr.strip()}")
            return
        job = json.loads(proc.stdout)
        complete = scan_ckpt_dir(job["spec"]["ckpt_dir"])[0]
        want = os.path.join(job["spec"]["ckpt_dir"], latest(complete)) if complete else None
        if job["state"] == "completed" and job["step"] != job["total_steps"]:
            self.fail(f"job {jid} completed at step {job['step']}/{job['total_steps']}")
        got = job.get("last_checkpoint")
        if (got and os.path.realpath(got)) != (want and os.path.realpath(want)):
            self.fail(f"job {jid}: last_checkpoint {got}, the latest on disk is {want}")
        try:
            db = sqlite3.connect(f"file:{self.daemon.state_dir}/astraid.db?mode=ro", uri=True,
                                 timeout=10)
            row = db.execute("SELECT state FROM jobs WHERE id=?", (jid,)).fetchone()
            open_runs = db.execute("SELECT count(*) FROM runs WHERE job_id=? AND finished_at "
                                   "IS NULL", (jid,)).fetchone()[0]
            db.close()
        except sqlite3.Error as e:
            self.fail(f"astraid.db unreadable: {e}")
            return
        if not row or row[0] != job["state"]:
            self.fail(f"job {jid}: astraid.db says {row and row[0]}, status says {job['state']}")
        if job["state"] in FINAL and open_runs:
            self.fail(f"job {jid} is {job['state']} with {open_runs} run(s) never ended in the db")

    # ------------------------------------------------ the local launcher
    def local_args(self, config, ckpt_dir, resume=False):
        args = dict(self.setup.flags(config), ckpt_dir=ckpt_dir)
        if resume:
            args["resume"] = "true"
        return [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in args.items()]

    def launch(self, config, ckpt_dir, resume=False):
        with open(os.path.join(self.root, f"launch{len(self.launcher_pids)}.log"), "wb") as out:
            p = subprocess.Popen(self.local_args(config, ckpt_dir, resume), stdout=out,
                                 stderr=out, start_new_session=True)
        self.launcher_pids.add(p.pid)
        return p

    # ------------------------------------------------ checks
    def check_final(self, ckpt_dir, config, seed, what):
        ref_name, ref_sha, _ = self.setup.reference(config, seed)
        complete, problems, leftovers = scan_ckpt_dir(ckpt_dir)
        for p in problems:
            self.fail(p)
        for p in leftovers:
            self.fail(f"leftover {p} after the job ended")
        name = latest(complete)
        if name != ref_name:
            self.fail(f"{what}: final checkpoint {name}, the undisturbed run ends at {ref_name}")
        elif complete[name] != ref_sha:
            self.fail(f"{what}: {name}'s model files differ from the undisturbed run's")
        for d, names in self.before.items():
            now = scan_ckpt_dir(d)[0]
            lost = sorted(set(names) - set(now))
            if lost:
                self.fail(f"checkpoints lost in {d}: {', '.join(lost[:5])}")

    def check_processes(self):
        """No astrai-train of the case alive, no /dev/shm entry of its processes left."""
        deadline = time.time() + 15 * SLOW
        while train_procs(self.root) and time.time() < deadline:
            time.sleep(0.1)
        left = train_procs(self.root)
        if left:
            self.fail("orphan astrai-train processes: " + ", ".join(
                f"{pid} (rank {r}, {proc_status(pid)})" for pid, r in sorted(left.items())))
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.watcher.stop()
        pids = set(self.watcher.seen) | self.launcher_pids | self.daemon_pids
        leaked, kmp = own_shm(shm_entries() - self.shm_before, pids)
        if leaked:
            self.fail(f"/dev/shm leftovers: {', '.join(leaked)}")
        if kmp:
            self.note(f"{len(kmp)} libomp registration file(s) of killed processes removed")
        for e in leaked + kmp:
            try:
                os.unlink(os.path.join("/dev/shm", e))
            except OSError:
                pass

    # ------------------------------------------------ run
    def run(self):
        self.watcher.start()
        try:
            getattr(self, "case_" + self.kind)()
        except Exception as e:  # a broken case is a failure to report, not the end of the run
            self.fail(f"{type(e).__name__}: {e}")
        finally:
            try:
                self.stop_daemon()
            except Exception as e:
                self.fail(f"stopping astraid: {e}")
            self.check_processes()
            for m in self.mounts:
                umount(m)
        return self.failures

    # ------------------------------------------------ daemon kinds
    def train_under_daemon(self, config, **extra):
        """Starts astraid and a job; returns (job id, ckpt_dir) once it runs."""
        self.start_daemon()
        c = self.client()
        jid = self.submit(c, config, **extra)
        c.close()
        st = self.wait_running(jid)
        return jid, st["spec"]["ckpt_dir"]

    def case_kill9_astraid(self):
        jid, ckpt = self.train_under_daemon(self.config)
        self.wait_moment(ckpt, self.config)
        self.daemon.kill9()
        ranks = set(self.watcher.seen)
        if not du.wait_gone(ranks, 30 * SLOW):
            self.fail(f"ranks {sorted(p for p in ranks if du.pid_alive(p))} outlived astraid")
        self.start_daemon()
        self.finish_job(jid, self.config)

    def case_kill9_rank(self, sig=signal.SIGKILL):
        rank = self.rng.randrange(CONFIGS[self.config][1])
        self.note(f"rank {rank}")
        jid, ckpt = self.train_under_daemon(self.config)
        pid = self.rank_pid(rank)
        self.wait_moment(ckpt, self.config)
        if pid is None or not du.pid_alive(pid):
            self.note("the rank was gone before the moment")
        else:
            os.kill(pid, sig)
        self.finish_job(jid, self.config)

    def case_sigterm_rank(self):
        self.case_kill9_rank(signal.SIGTERM)

    def mounted_ckpt(self, size_kib):
        ckpt = os.path.join(self.root, "ckpt")
        self.mount(ckpt, size_kib)
        return ckpt

    def case_enospc_ckpt(self):
        # Room for a few checkpoints of the tiny model (~1.2 MB each; none are removed).
        size = self.rng.randint(2, 12) * 1200
        self.note(f"tmpfs {size} KiB")
        ckpt = self.mounted_ckpt(size)
        jid, _ = self.train_under_daemon(self.config, ckpt_dir=ckpt, max_restarts=1)
        # A restart that finds too little room for the next checkpoint waits queued for it
        # (docs/astraid.md *Preflight*): the operator's cue to make room, as one that failed is.
        st = self.wait_state(jid, FINAL, 240, until=lambda j: j["state"] == "queued" and
                             (j.get("error") or "").startswith("preflight: "))
        self.snapshot(ckpt)
        remount(ckpt, "size=1g")
        if st["state"] == "completed":
            self.note("the tmpfs did not fill")
        elif st["state"] == "queued":
            self.note(f"waited for room: {st['error']!r:.100}")
        self.finish_job(jid, self.config, resume_failed=True)

    def case_readonly_ckpt(self):
        ckpt = self.mounted_ckpt(1 << 20)
        jid, _ = self.train_under_daemon(self.config, ckpt_dir=ckpt, max_restarts=1)
        self.wait_moment(ckpt, self.config)
        remount(ckpt, "ro")
        st = self.wait_state(jid, FINAL, 240)
        remount(ckpt, "rw")
        if st["state"] == "completed":
            self.note("completed before the remount")
        self.finish_job(jid, self.config, resume_failed=True)

    def case_enospc_state(self):
        """Submits while the state dir is full: what was acknowledged survives a restart."""
        state = os.path.join(self.root, "state")
        self.mount(state, 16 << 10)
        ckpt = os.path.join(self.root, "ckpt")
        jid, _ = self.train_under_daemon(self.config, ckpt_dir=ckpt)
        self.wait_moment(ckpt, self.config)
        filler = os.path.join(state, "filler")
        with open(filler, "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * 65536):
                    pass
            except OSError:
                pass
        # Some room back (or none): submits go from durable to refused as it fills again.
        room = self.rng.choice([0, 16, 64, 256]) << 10
        os.truncate(filler, max(0, os.path.getsize(filler) - room))
        acked, refused = [], []
        c = self.client()
        for i in range(self.rng.randint(5, 30)):
            try:
                # Waits behind the first job (it wants every device): never starts here.
                acked.append(self.submit(c, "ddp", name=f"extra{i}", ckpt_dir=ckpt + f"-{i}",
                                         priority=-1, devices=2, nprocs=2))
            except du.RpcError as e:
                refused.append(e.message[:120])
        c.close()
        self.note(f"{len(acked)} submits acknowledged, {len(refused)} refused"
                  + (f" ({refused[0]})" if refused else ""))
        self.daemon.kill9()
        os.unlink(filler)
        self.start_daemon()
        c = self.client()
        have = {j["id"] for j in c.call("list", {})["jobs"]}
        missing = [j for j in acked if j not in have]
        if missing:
            self.fail(f"acknowledged submits lost after a restart: jobs {missing}")
        for j in acked:
            if j in have:
                try:
                    c.call("cancel", {"job": j})
                except du.RpcError:
                    pass
        c.close()
        self.finish_job(jid, self.config, resume_failed=True)

    def case_readonly_state(self):
        """astraid (re)started on a read-only state dir: it refuses with exit 1 naming it; rw
        again, it resumes the job. (A state dir in use cannot be remounted read-only: astraid
        and rank 0 keep files open for writing there.)"""
        state = os.path.join(self.root, "state")
        self.mount(state, 256 << 10)
        ckpt = os.path.join(self.root, "ckpt")
        jid, _ = self.train_under_daemon(self.config, ckpt_dir=ckpt)
        self.wait_moment(ckpt, self.config)
        self.daemon.kill9()
        du.wait_gone(set(self.watcher.seen), 30 * SLOW)
        remount(state, "ro")
        if self.start_daemon(expect_ok=False):
            self.fail("astraid started on a read-only state dir")
            self.daemon.kill9()
        else:
            self.daemon.proc.wait()
            self.daemon.log.close()
            if self.daemon.proc.returncode != 1:
                self.fail(f"astraid exited {self.daemon.proc.returncode} on a read-only state "
                          f"dir, not 1")
            if state not in self.last_log_line():
                self.fail(f"astraid's refusal does not name the state dir: "
                          f"{self.last_log_line()[:200]}")
        remount(state, "rw")
        self.start_daemon()
        self.finish_job(jid, self.config, resume_failed=True)

    def damage_db(self):
        db = os.path.join(self.daemon.state_dir, "astraid.db")
        if self.kind == "db_deleted":
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(db + suffix):
                    os.unlink(db + suffix)
        elif self.kind == "db_emptied":
            open(db, "wb").close()
            for suffix in ("-wal", "-shm"):
                if os.path.exists(db + suffix):
                    os.unlink(db + suffix)
        else:  # db_corrupt: random bytes over its header, a random page, or its WAL
            where = self.rng.choice(["header", "page", "wal"])
            path = db + "-wal" if where == "wal" and os.path.exists(db + "-wal") else db
            size = os.path.getsize(path)
            at = 0 if where == "header" else self.rng.randrange(max(size, 1))
            n = self.rng.randint(16, 4096)
            self.note(f"{n} random bytes at {os.path.basename(path)}:{at}")
            with open(path, "r+b") as f:
                f.seek(at)
                f.write(self.rng.randbytes(n))

    def case_db(self):
        """astraid.db damaged while astraid was down: a new job must not take an old job's
        directory, checkpoints or logs; the old job's checkpoints stay."""
        jid, ckpt = self.train_under_daemon(self.config)
        self.wait_moment(ckpt, self.config)
        # Down by kill -9 (its WAL stays beside the db) or by SIGTERM (the WAL merged).
        if self.rng.random() < 0.5:
            self.note("astraid stopped by SIGTERM")
            self.stop_daemon()
        else:
            self.daemon.kill9()
        du.wait_gone(set(self.watcher.seen), 30 * SLOW)
        self.snapshot(ckpt)  # with what the ranks saved as they stopped
        old = {n: model_digest(os.path.join(ckpt, n)) for n in scan_ckpt_dir(ckpt)[0]}
        self.damage_db()
        if not self.start_daemon(expect_ok=False):
            if self.daemon.proc.poll() is None:
                self.daemon.proc.kill()
            self.daemon.proc.wait()
            self.daemon.log.close()
            self.note(f"astraid refused it: {self.last_log_line()[:160]}")
            if self.daemon.proc.returncode != 1:
                self.fail(f"astraid exited {self.daemon.proc.returncode} on a damaged db, not 1")
            if "astraid.db" not in self.daemon.logs():
                self.fail("astraid's refusal does not name astraid.db")
            # The operator moves the damaged database aside.
            db = os.path.join(self.daemon.state_dir, "astraid.db")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(db + suffix):
                    os.rename(db + suffix, db + suffix + ".damaged")
            self.start_daemon()
        c = self.client()
        new = self.submit(c, self.config, seed=8)
        c.close()
        st = self.finish_job(new, self.config, seed=8)
        if new == jid:
            self.note(f"the new job took id {jid} again")
        if st.get("spec", {}).get("ckpt_dir") == ckpt:
            self.fail(f"the new job {new} writes the old job's ckpt_dir {ckpt}")
        now = scan_ckpt_dir(ckpt)[0]
        changed = [n for n, h in old.items() if now.get(n) != h]
        if changed:
            self.fail(f"the old job's checkpoints changed or vanished: {', '.join(changed[:5])}")

    case_db_deleted = case_db_emptied = case_db_corrupt = case_db

    # ------------------------------------------------ local launcher kinds
    def local_case(self, target, sig):
        ckpt = os.path.join(self.root, "ckpt")
        p = self.launch(self.config, ckpt)
        rank = self.rng.randrange(CONFIGS[self.config][1])
        pid = p.pid if target == "launcher" else self.rank_pid(rank)
        if target != "launcher":
            self.note(f"rank {rank}")
        self.wait_moment(ckpt, self.config)
        if pid and du.pid_alive(pid):
            os.kill(pid, sig)
        try:
            rc = p.wait(timeout=120 * SLOW)
        except subprocess.TimeoutExpired:
            self.fail("the launcher did not exit within 120 s")
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        ranks = set(self.watcher.seen) - {p.pid}
        if not du.wait_gone(ranks, 30 * SLOW):
            self.fail(f"ranks {sorted(r for r in ranks if du.pid_alive(r))} outlived the launcher")
        complete = scan_ckpt_dir(ckpt)[0]
        ref_name = self.setup.reference(self.config)[0]
        ended = latest(complete) == ref_name
        self.note(f"launcher exit {rc}")
        if sig == signal.SIGTERM:
            if rc == 0 and not ended:
                self.fail(f"launcher exit 0 after a SIGTERM at {latest(complete)} (not the end)")
            elif not ended and rc != 3:
                self.fail(f"launcher exit {rc} after a SIGTERM, expected 3 (interrupted)")
        elif target == "rank" and not ended and rc != 128 + signal.SIGKILL:
            # The launcher exits with its first failing rank's code, 128+signal for a signal
            # (train/launch.h), as a shell reports a killed child.
            self.fail(f"launcher exit {rc} after kill -9 of a rank, expected {128 + signal.SIGKILL}")
        if not ended:
            again = self.launch(self.config, ckpt, resume=bool(complete))
            rc = again.wait(timeout=300 * SLOW)
            if rc != 0:
                self.fail(f"rerun with --resume exited {rc}")
        self.check_final(ckpt, self.config, 7, "rerun")

    def case_kill9_launcher(self):
        self.local_case("launcher", signal.SIGKILL)

    def case_sigterm_launcher(self):
        self.local_case("launcher", signal.SIGTERM)

    def case_kill9_rank_local(self):
        self.local_case("rank", signal.SIGKILL)

    def case_sigterm_rank_local(self):
        self.local_case("rank", signal.SIGTERM)


# ---------------------------------------------------------------- the matrix

def draw_cases(seed, count, short):
    rng = random.Random(seed)
    if short:
        return [(i, rng.randrange(1 << 32), k, c) for i, (k, c) in enumerate(SHORT)]
    out = []
    for i in range(count):
        kind = rng.choice(DAEMON_KINDS + LOCAL_KINDS)
        configs = ["ddp", "fsdp", "pp", "sharded"] if kind in LOCAL_KINDS else list(CONFIGS)
        out.append((i, rng.randrange(1 << 32), kind, rng.choice(configs)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the CI subset")
    ap.add_argument("--count", type=int, default=100, help="cases of the long mode")
    ap.add_argument("--seed", type=int, default=None, help="default: drawn (and printed)")
    ap.add_argument("--case", type=int, action="append", help="run only these cases")
    ap.add_argument("--kind", action="append", help="run only cases of these kinds")
    ap.add_argument("--windows", type=int, default=None,
                    help="dataset windows (default 160 short, 320 long)")
    ap.add_argument("--keep", action="store_true", help="keep the case directories")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    mode = ("--short" if args.short else f"--count {args.count}") + (
        f" --windows {args.windows}" if args.windows else "")
    log(f"fault matrix: seed {seed} ({mode}); reproduce a case with "
        f"{sys.argv[0]} {mode} --seed {seed} --case I")
    base = tempfile.mkdtemp(prefix="astrai-faults-")
    setup = Setup(base, args.windows or (160 if args.short else 320))
    why_no_mount = mount_permitted(base)
    if why_no_mount:
        log(f"skipping {', '.join(MOUNT_KINDS)}: {why_no_mount}")
    cases = draw_cases(seed, args.count, args.short)
    results, failed = {}, 0
    t_start = time.time()
    for index, case_seed, kind, config in cases:
        if args.case and index not in args.case or args.kind and kind not in args.kind:
            continue
        if kind in MOUNT_KINDS and why_no_mount:
            results.setdefault(kind, []).append("skipped")
            continue
        setup.reference(config)
        case = Case(setup, base, index, case_seed, kind, config)
        t0 = time.time()
        failures = case.run()
        verdict = "FAIL" if failures else "ok"
        results.setdefault(kind, []).append(verdict)
        log(f"case {index:3d} {kind:18s} {config:4s} moment {case.moment}@{case.fraction:.2f} "
            f"{time.time() - t0:5.1f} s  {verdict}  {'; '.join(case.notes)}")
        for f in failures:
            log(f"    - {f}")
        if failures:
            failed += 1
            log(f"    reproduce: {sys.argv[0]} {mode} --seed {seed} --case {index}")
        if not args.keep and not failures:
            shutil.rmtree(case.root, ignore_errors=True)
    log(f"\n{sum(len(v) for v in results.values())} cases in {time.time() - t_start:.0f} s "
        f"(seed {seed}):")
    for kind in sorted(results):
        v = results[kind]
        log(f"  {kind:18s} " + "  ".join(f"{s} {v.count(s)}" for s in ("ok", "FAIL", "skipped")
                                          if v.count(s)))
    if not args.keep and not failed:
        shutil.rmtree(base, ignore_errors=True)
    elif failed:
        log(f"case directories (logs, checkpoints) kept under {base}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
