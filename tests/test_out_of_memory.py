"""Out of memory is a resource failure, never bad input and never a crash (common/error.h):
tests/fail_alloc.c, preloaded, makes the Nth allocation after main starts fail, SQLite's way,
for N over the start paths of

- astrai-train: a tiny model and dataset, one optimizer step, its checkpoint;
- astrai-train in bf16 on the CPU, counting only aligned_alloc (FAIL_ALLOC_ONLY): the training
  allocations, the ops' fp32 scratch that grows inside the first step included, where a failure
  is the backend's (engine/backend.h): exit 1 naming the op, nothing of the step written;
- astraid: a fresh state directory, daemon.info, a submit of a tiny job that runs to its end
  (the ranks are the real astrai-train, allocating normally), then SIGTERM.

At each N the process is not killed by a signal (but for the aborts of libuv, which answers
some of its own failed allocations so: library_abort), does not exit 2 (bad input), and either
succeeds (the allocation was optional, or retried) or exits 1 naming out of memory (ours,
strerror(ENOMEM) or libuv's "not enough memory"). astraid also answers every request (an
internal error naming memory at worst, after which the request is sent again, on a new
connection when astraid hung up for want of memory to read it), and never fails the job: a
run that could not start for want of memory is tried again, and the job completes.

A first run with the library in counting mode lists the allocations and the object that made
each (astrai's binary, libsqlite3, libgomp, libc, libuv; cJSON's count as the binary's: its
hooks are ours). N then runs over the allocations of astrai's own code and a stride through
the libraries', at most ASTRAI_OOM_RUNS runs per path (default 300 for astrai-train, 100 for
astraid; 0: every allocation; ASTRAI_OOM_ONLY=N,N,... runs those). The libraries' other
failures come out under the same rule (libgomp's "out of memory allocating", exit 1;
SQLITE_NOMEM; UV_ENOMEM). The summary printed at the end counts the outcomes by the object
whose allocation failed, and the library aborts by cause.

Not in the sanitizer build (tests/oom.cmake): ASan replaces malloc inside the binaries.
Run one path with its name as argument (train, train_bf16, daemon); none runs them all."""

import collections
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import daemon_util as du
import train_util as tu

SHIM = os.path.join(tu.BUILD, "libfail_alloc.so")
RUNS = os.environ.get("ASTRAI_OOM_RUNS")
ONLY = [int(n) for n in os.environ.get("ASTRAI_OOM_ONLY", "").split(",") if n]
# ours, strerror(ENOMEM), libuv's uv_strerror(UV_ENOMEM)
OOM_TEXT = ("out of memory", "cannot allocate memory", "not enough memory")
WINDOW, BATCH = 16, 2


def names_oom(text):
    return any(t in text.lower() for t in OOM_TEXT)


def shim_env(n, log, only=None):
    env = {"LD_PRELOAD": SHIM, "FAIL_ALLOC_LOG": log}
    if n:
        env["FAIL_ALLOC_N"] = str(n)
    if only:
        env["FAIL_ALLOC_ONLY"] = only
    return env


def read_log(log):
    """The object of each call by number, and the failed call's object with its backtrace
    (None when the run made fewer than N calls)."""
    calls, failed = {}, None
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        parts = line.split()
        if parts[:1] == ["failed"]:
            trace = []
            for t in lines[i + 1:]:
                if not t.startswith("  "):
                    break
                trace.append(t.strip())
            failed = (parts[2], trace)
        elif len(parts) == 2 and parts[0].isdigit():
            calls[int(parts[0])] = parts[1]
    return calls, failed


def spread(xs, k):
    """k of xs, evenly spaced (all of them when k >= len(xs))."""
    if k >= len(xs):
        return list(xs)
    return [xs[i * len(xs) // k] for i in range(k)]


def choose(calls, own, budget):
    """The call numbers to fail: those of astrai's own code (the object named own), then a
    stride through the libraries', budget in all (0: every call); ASTRAI_OOM_ONLY's when
    given."""
    if ONLY:
        return ONLY
    numbers = sorted(calls)
    if not budget or len(numbers) <= budget:
        return numbers
    mine = [n for n in numbers if calls[n] == own]
    theirs = [n for n in numbers if calls[n] != own]
    k = min(len(mine), budget * 2 // 3)
    return sorted(spread(mine, k) + spread(theirs, budget - k))


def library_abort(rc, text, failed):
    """Why an abort is a library's answer to its own failed allocation, which no caller can
    catch (None when it is not): libuv abort()s, without a message, when it cannot grow its
    watcher table (uv__io_start, under uv_default_loop, uv_listen, ...) or start the threads
    of its pool (pthread_create under uv_once, at the first uv_queue_work). An assertion
    (a caller's misuse) is never one."""
    if rc != -signal.SIGABRT or not failed or "Assertion" in text:
        return None
    obj, trace = failed
    if any("uv_thread_create" in t for t in trace):
        return "libuv aborts when it cannot start its threadpool"
    if obj == "libuv.so.1":
        return "libuv aborts when it cannot grow its watcher table"
    return None


class Walk:
    """The outcomes of one path: problems found, and a count by (failed object, outcome)."""

    def __init__(self, name):
        self.name, self.problems, self.counts = name, [], collections.Counter()
        self.known = collections.Counter()

    def judge(self, n, rc, text, failed, notes=()):
        obj = failed[0] if failed else "none"
        where = f"{self.name} N={n} (an allocation of {obj})"
        why = library_abort(rc, text, failed)
        if why:
            self.counts[(obj, "library abort")] += 1
            self.known[why] += 1
            return
        bad = []
        if rc < 0:
            bad.append(f"killed by signal {-rc}")
        elif rc == 2:
            bad.append("exit 2 (bad input)")
        elif rc not in (0, 1):
            bad.append(f"exit {rc}")
        elif rc == 1 and not names_oom(text):
            bad.append("exit 1 without naming out of memory")
        bad += list(notes)
        self.counts[(obj, "problem" if bad else f"exit {rc}")] += 1
        if bad:
            trace = "\n    ".join(failed[1][:12]) if failed else ""
            self.problems.append(f"{where}: {'; '.join(bad)}\n  last output: "
                                 f"{text.strip().splitlines()[-3:]}\n    {trace}")

    def report(self):
        print(f"{self.name}: {sum(self.counts.values())} runs")
        for (obj, outcome), k in sorted(self.counts.items()):
            print(f"  {obj:24} {outcome:13} {k}")
        for why, k in sorted(self.known.items()):
            print(f"  not ours ({k} N): {why}")
        for p in self.problems:
            print("FAIL:", p)
        return self.problems


# ---------------------------------------------------------------- astrai-train

def train_args(model, data, ckpt, dtype="fp32"):
    return [tu.binary("astrai-train"), "--train_type=seq", f"--param_path={model}",
            f"--data_root_path={data}", f"--batch_per_device={BATCH}",
            f"--window_size={WINDOW}", "--threads=1", "--max_steps=1", f"--ckpt_dir={ckpt}",
            "--device_type=cpu", f"--dtype={dtype}"]


def run_train(root, model, data, n, dtype="fp32", only=None):
    ckpt, log = os.path.join(root, "ck"), os.path.join(root, "alloc.log")
    shutil.rmtree(ckpt, ignore_errors=True)
    if os.path.exists(log):
        os.remove(log)
    proc = subprocess.run(train_args(model, data, ckpt, dtype), capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **shim_env(n, log, only)))
    return proc.returncode, proc.stdout + proc.stderr, log


def walk_train(root, model, data):
    w = Walk("astrai-train")
    rc, text, log = run_train(root, model, data, 0)
    assert rc == 0, f"astrai-train without a failure: exit {rc}\n{text}"
    calls, _ = read_log(log)
    for n in choose(calls, "astrai-train", int(RUNS or 300)):
        rc, text, log = run_train(root, model, data, n)
        w.judge(n, rc, text, read_log(log)[1])
    return w


# The message of an op of the bf16 CPU backend that had no memory for its fp32 scratch
# (engine/backend.h's failure rule, recorded and reported by the trainer at the step's end).
SCRATCH_OOM = re.compile(r"cpu bf16 backend: bf16_\w+: out of memory for [0-9.]+ MiB of fp32 scratch")


def walk_train_bf16(root, model, data):
    """bf16 on the CPU: every aligned_alloc of the run (the model's buffers, the activations, and
    the ops' fp32 scratch, which grows inside the first step) fails in turn. A scratch that could
    not grow is the backend's failure: exit 1 naming the op, and nothing of the step written
    (no checkpoint, no step row in progress.db)."""
    w = Walk("astrai-train bf16 (aligned_alloc)")
    rc, text, log = run_train(root, model, data, 0, "bf16", "aligned_alloc")
    assert rc == 0, f"astrai-train bf16 without a failure: exit {rc}\n{text}"
    calls, _ = read_log(log)
    in_step = 0
    for n in choose(calls, "astrai-train", int(RUNS or 300)):
        rc, text, log = run_train(root, model, data, n, "bf16", "aligned_alloc")
        notes = []
        if SCRATCH_OOM.search(text):
            in_step += 1
            ck = os.path.join(root, "ck")
            written = sorted(os.listdir(ck)) if os.path.isdir(ck) else []
            db = os.path.join(ck, "progress.db")
            steps = 0
            if os.path.exists(db):
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
                    steps = c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
            if rc != 1:
                notes.append(f"a scratch failure exits {rc}, not 1")
            if any(not f.startswith(("progress.db", ".astrai")) for f in written) or steps:
                notes.append(f"a failed step left {written} in ckpt_dir, {steps} step rows")
        w.judge(n, rc, text, read_log(log)[1], notes)
    print(f"  {in_step} of them failed an op's scratch inside the step")
    if not in_step:
        w.problems.append("no run failed an op's fp32 scratch: the walk missed the step")
    return w


# ---------------------------------------------------------------- astraid

class Unanswered(Exception):
    pass


class Session:
    """Requests to one astraid. An internal error naming memory (the one injected failure)
    is followed by the request again, and so is a connection astraid closed after one
    (a request it had no memory to read): on a new connection. Any other error, or none
    answered in time, is a problem."""

    def __init__(self, d):
        self.d, self.client = d, None

    def connect(self, timeout=60):
        """Whether a connection is open (astraid may have exited first)."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.d.proc.poll() is None:
            try:
                self.client = du.Client(self.d.socket, timeout=60)
                return True
            except OSError:
                time.sleep(0.02)
        return False

    def close(self):
        if self.client:
            self.client.close()

    def call(self, method, params=None, again=True):
        """The result; None for an out-of-memory error when again is False."""
        for attempt in range(2):
            try:
                return self.client.call(method, params)
            except du.RpcError as e:
                if attempt or e.code != -32603 or not names_oom(e.message):
                    raise Unanswered(f"{method}: error {e.code}: {e.message}")
                if not again:
                    return None
            except ConnectionError as e:
                if attempt or not names_oom(self.d.logs()):
                    raise Unanswered(f"{method}: no answer ({e})")
            except (OSError, KeyError) as e:
                raise Unanswered(f"{method}: no answer ({type(e).__name__}: {e})")
            self.close() # astraid may have hung up after its error
            if not self.connect():
                raise Unanswered(f"{method}: astraid exited after out of memory")

    def submit(self, spec):
        """The job's id. A submit answered out of memory may have been carried out (its
        reply is what failed): the job list says, else it is sent again."""
        submitted = self.call("submit", spec, again=False)
        if submitted is None:
            jobs = self.call("list")["jobs"]
            submitted = {"job": jobs[0]["id"]} if jobs else self.call("submit", spec)
        if "job" not in submitted:
            raise Unanswered(f"submit answered without the job's id: {submitted}")
        return submitted["job"]

    def wait_completed(self, job, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.call("status", {"job": job})
            if "state" not in st:
                raise Unanswered(f"status of job {job} without its state: {st}")
            if st["state"] == "completed":
                return
            if st["state"] in ("failed", "cancelled"):
                raise Unanswered(f"job {job} {st['state']}: {st.get('error')}")
            time.sleep(0.02)
        raise Unanswered(f"job {job} not completed within {timeout} s")


def run_daemon(root, spec, n):
    """astraid's exit code, its log, the allocation log and the problems of its answers."""
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    log = os.path.join(root, "alloc.log")
    d = du.Daemon(root, env=shim_env(n, log)).start(wait=False)
    notes = []
    s = Session(d)
    if s.connect():
        try:
            s.call("daemon.info")
            s.wait_completed(s.submit(spec))
        except Unanswered as e:
            notes.append(str(e))
        except (KeyError, TypeError) as e:  # a result without what the test reads
            notes.append(f"a result without {e}")
        s.close()
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
    return d.wait(120), d.logs(), log, notes


def walk_daemon(root, model, data):
    w = Walk("astraid")
    spec = du.spec(model, data, window_size=WINDOW, batch_per_device=BATCH, max_steps=1,
                   ckpt_dir=os.path.join(root, "d", "ck"))
    rc, text, log, notes = run_daemon(os.path.join(root, "d"), spec, 0)
    assert rc == 0 and not notes, f"astraid without a failure: exit {rc}, {notes}\n{text}"
    calls, _ = read_log(log)
    for n in choose(calls, "astraid", int(RUNS or 100)):
        rc, text, log, notes = run_daemon(os.path.join(root, "d"), spec, n)
        w.judge(n, rc, text, read_log(log)[1], notes)
    return w


def main():
    if os.environ.get("ASTRAI_SANITIZED") in ("1", "ON", "TRUE", "true"):
        print("skipped: the sanitizer build replaces malloc (tests/oom.cmake)")
        return 77
    parts = sys.argv[1:] or ["train", "train_bf16", "daemon"]
    root = tu.tmpdir()
    model = tu.make_model(os.path.join(root, "m"))
    data, _ = tu.make_text_data(root, 8 * WINDOW * BATCH + 1)
    walks = {"train": walk_train, "train_bf16": walk_train_bf16, "daemon": walk_daemon}
    problems = []
    for part in parts:
        t0 = time.time()
        problems += walks[part](root, model, data).report()
        print(f"  ({time.time() - t0:.0f} s)")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
