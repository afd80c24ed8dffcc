"""What astraid decides about a job's runs and paths, each case one that went wrong before:

- interrupt: a rank stopped by a SIGTERM astraid did not send (one rank; rank 1 of a ddp
  job) is interrupted work, never `completed` at a partial step: the job restarts from the
  stop checkpoint (one restart) and completes at total_steps; a max_steps job completes at
  max_steps with eta_s 0.
- restarts: a run that saved a new checkpoint forgives earlier restarts (3 kills with
  max_restarts 1 still complete), one that saved nothing does not; a failed job's error
  quotes only the failing run's output; ranks that exit 0 short of total_steps do not
  complete the job (stand-in ranks); a run that cannot start for want of file
  descriptors (EMFILE on the rendezvous listener, then on the rank log) waits in the queue
  and completes once they are back.
- paths: submit refuses a missing param_path/data_root_path, a model directory without
  config.json or weights, a ckpt_dir another live job uses (same, inside, around, through a
  symlink), the root, system directories, astraid's state directory and another job's run
  directory, a ckpt_dir under a file or on a read-only file system; resume refuses a
  ckpt_dir taken meanwhile; a ckpt_dir that turns read-only under a run fails the job at
  once, without restarts.
- devices: `--devices cpu:0` and GPUs NVML does not find exit 2 at start.

Run one part with its name as argument; none runs them all."""

import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import daemon_util as du
import train_util as tu

EPOCHS = 6  # 120 steps on one rank
DDP = {"nprocs": 2, "parallel_mode": "ddp", "batch_per_device": 2}


def daemon(root, name, **kw):
    """A started astraid in root/name."""
    os.makedirs(os.path.join(root, name), exist_ok=True)
    return du.Daemon(os.path.join(root, name), **kw).start()


def running_pids(c, jid, pred=None):
    """The rank pids of the job's live run once it runs (and pred(job) holds)."""
    job = du.running(c, jid, pred)
    return job, [r["pid"] for r in job["ranks"]]


# ---------------------------------------------------------------- interrupt

def check_outside_sigterm(d, c, model, data, rank, **extra):
    """SIGTERM to one rank from outside astraid: the run stops with a checkpoint, the job
    is restarted from it and completes at total_steps."""
    jid = c.call("submit", du.spec(model, data, n_epoch=EPOCHS, **extra))["job"]
    with du.hold(c, jid) as held:  # the SIGTERM at step 10, however fast the machine
        held.advance(du.progress_db(d, jid), to=10)
        pids = held.pids
        os.kill(pids[rank], signal.SIGTERM)
    assert du.wait_gone(pids, 60), f"ranks {pids} did not stop after SIGTERM"
    done = du.wait_job(c, jid, ["completed"], timeout=180)
    assert done["step"] == done["total_steps"] > 0, f"completed at a partial step: {done}"
    assert done["restarts"] == 1 and done["error"] is None, done
    assert done["eta_s"] == 0, done
    restarts = du.events(d, jid, "restart")
    assert len(restarts) == 1 and "interrupted at step" in restarts[0], restarts
    with open(os.path.join(d.state_dir, "jobs", str(jid), "run2-rank0.log")) as f:
        assert "resum" in f.read().lower(), "run 2 did not resume from the stop checkpoint"


def check_max_steps(c, model, data):
    """A run that stops at max_steps reached its end: completed, ETA 0, no restart."""
    jid = c.call("submit", du.spec(model, data, n_epoch=4, max_steps=7))["job"]
    done = du.wait_job(c, jid, ["completed"])
    assert done["step"] == 7 and done["total_steps"] == 80, done
    assert done["restarts"] == 0 and done["eta_s"] == 0, done


def part_interrupt(root, model, data):
    d = daemon(root, "interrupt", devices="cpu:2")
    with du.guarded(d):
        c = d.client()
        check_max_steps(c, model, data)
        check_outside_sigterm(d, c, model, data, 0)
        check_outside_sigterm(d, c, model, data, 1, **DDP)
        c.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- restarts

def check_forgiven(d, c, model, data):
    """Three kills, each after the run saved a new checkpoint, with max_restarts 1."""
    jid = c.call("submit", du.spec(model, data, n_epoch=12, ckpt_interval=20,
                                   max_restarts=1))["job"]
    seen, killed = None, None  # the checkpoint the current run started from; the last rank
    for _ in range(3):
        # Each run held, let on until it saved a checkpoint past `seen`, killed while held:
        # it cannot end first, nor save another before the kill, however fast the machine.
        with du.hold(c, jid, lambda j: j["ranks"][0]["pid"] != killed) as held:
            seen = du.checkpoint_past(c, d, jid, held, seen)
            killed = held.pids[0]
            os.kill(killed, signal.SIGKILL)
    done = du.wait_job(c, jid, ["completed"], timeout=180)
    assert done["restarts"] == 1 and done["step"] == done["total_steps"], done


def check_not_forgiven(c, model, data):
    """Kills before any new checkpoint count: the second one fails a max_restarts 1 job."""
    jid = c.call("submit", du.spec(model, data, n_epoch=400, max_restarts=1))["job"]
    _, first = running_pids(c, jid)
    os.kill(first[0], signal.SIGKILL)
    _, second = running_pids(c, jid, lambda j: j["ranks"][0]["pid"] != first[0])
    os.kill(second[0], signal.SIGKILL)
    failed = du.wait_job(c, jid, ["failed"])
    assert failed["restarts"] == 1 and "killed by signal 9" in failed["error"], failed


FAKE_TRAIN = """#!/usr/bin/python3
# A stand-in astrai-train; what it does depends on --random_seed.
#   1: run N prints its own lines and exits 1;
#   2: writes progress.db rows up to step 4 of 10 and exits 0 (short of its end).
import glob, os, sqlite3, sys, time
run_dir = os.environ["ASTRAI_RUN_DIR"]
if "--random_seed=1" in sys.argv:
    n = len(glob.glob(os.path.join(run_dir, "run*-rank0.log")))
    for i in range(4 if n == 1 else 1):
        print(f"run {n} line {i}", file=sys.stderr, flush=True)
    sys.exit(1)
db = sqlite3.connect(os.path.join(run_dir, "progress.db"))
db.executescript("CREATE TABLE IF NOT EXISTS steps(step INTEGER PRIMARY KEY, epoch INTEGER,"
                 " consumed_samples INTEGER, loss REAL, lr REAL, grad_norm REAL,"
                 " tokens_per_s REAL, wall_time REAL);"
                 "CREATE TABLE IF NOT EXISTS run(key TEXT PRIMARY KEY, value);")
db.execute("INSERT OR REPLACE INTO run VALUES('total_steps', 10)")
for step in range(1, 5):
    db.execute("INSERT OR REPLACE INTO steps VALUES(?, 0, ?, 1.0, 1e-3, 1.0, 100.0, ?)",
               (step, 4 * step, time.time()))
db.commit()
"""


def check_stand_ins(root, model, data):
    """With a stand-in rank: the error of a job whose runs all failed quotes the last run's
    lines only; ranks that exit 0 short of total_steps do not complete the job."""
    fake = os.path.join(root, "fake-train")
    with open(fake, "w") as f:
        f.write(FAKE_TRAIN)
    os.chmod(fake, 0o755)
    d = daemon(root, "fake", args=[f"--train-binary={fake}"])
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data, max_restarts=1, random_seed=1))["job"]
        failed = du.wait_job(c, jid, ["failed"])
        error = failed["error"]
        assert "exited with code 1" in error and "run 2 line 0" in error, error
        assert "run 1" not in error, f"the error quotes an earlier run's lines: {error!r}"
        jid = c.call("submit", du.spec(model, data, max_restarts=1, random_seed=2))["job"]
        failed = du.wait_job(c, jid, ["failed"])
        assert failed["step"] == 4 and failed["restarts"] == 1, failed
        assert "ended at step 4 of 10" in failed["error"], failed["error"]
        c.close()
        assert d.stop() == 0


def free_fds(pid):
    """The two lowest descriptor numbers pid has free (the next two it would get)."""
    used = {int(x) for x in os.listdir(f"/proc/{pid}/fd")}
    free = [fd for fd in range(len(used) + 2) if fd not in used]
    return free[:2]


def check_out_of_fds(d, c, model, data):
    """No file descriptor left for a run's start: the job waits queued (first the
    rendezvous listener fails, then, with one fd more, the rank's log file) and completes
    once descriptors are back, without a restart counted."""
    pid = d.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (free_fds(pid)[0], hard))
    try:
        jid = c.call("submit", du.spec(model, data, n_epoch=2))["job"]
        du.wait_job(c, jid, ["queued", "starting"],
                    pred=lambda j: "Too many open files" in (j["error"] or ""))
        # One descriptor for the listener, none for the log file.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (free_fds(pid)[1], hard))
        waiting = du.wait_job(c, jid, ["queued", "starting"],
                              pred=lambda j: "could not be started" in (j["error"] or ""))
        assert "run" in waiting["error"] and "rank0.log" in waiting["error"], waiting
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    done = du.wait_job(c, jid, ["completed"], timeout=180)
    assert done["restarts"] == 0 and done["error"] is None, done
    assert du.events(d, jid, "retry"), "no retry event recorded"


def part_restarts(root, model, data):
    check_stand_ins(root, model, data)
    d = daemon(root, "restarts", devices="cpu:1")
    with du.guarded(d):
        c = d.client()
        check_out_of_fds(d, c, model, data)
        check_forgiven(d, c, model, data)
        check_not_forgiven(c, model, data)
        c.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- paths

def refused(c, spec, *fragments):
    du.expect_error(lambda: c.call("submit", spec), -32602, *fragments)


def check_inputs(c, root, model, data):
    missing = os.path.join(root, "no-such-dir")
    refused(c, du.spec(missing, data), "param_path", missing)
    empty = os.path.join(root, "empty-model")
    os.makedirs(empty, exist_ok=True)
    refused(c, du.spec(empty, data), "param_path", empty, "config.json")
    no_weights = os.path.join(root, "no-weights")
    os.makedirs(no_weights, exist_ok=True)
    with open(os.path.join(model, "config.json")) as src, \
            open(os.path.join(no_weights, "config.json"), "w") as dst:
        dst.write(src.read())
    refused(c, du.spec(no_weights, data), "param_path", "model.safetensors")
    refused(c, du.spec(model, missing), "data_root_path", missing)
    a_file = os.path.join(root, "records.jsonl")
    with open(a_file, "w") as f:
        f.write('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    refused(c, du.spec(model, a_file), "data_root_path", "not a directory")
    refused(c, du.spec(model, data, ckpt_dir=os.path.join(a_file, "ck")), "ckpt_dir", a_file)
    # dpo reads a record file: accepted (and cancelled: the only slot is busy)
    jid = c.call("submit", du.spec(model, a_file, train_type="dpo"))["job"]
    c.call("cancel", {"job": jid})


def check_places(d, c, root, model, data, busy):
    for place, why in [("/", "root directory"), ("/etc/astrai-ck", "/etc"),
                       ("/usr/local/astrai-ck", "/usr"), ("/var/lib/astrai-ck", "/var"),
                       ("/lib64/astrai-ck", "system directory"), ("/proc/astrai-ck", "/proc"),
                       (d.state_dir, "state directory"),
                       (os.path.join(d.state_dir, "jobs", str(busy), "checkpoints"),
                        "state directory")]:
        refused(c, du.spec(model, data, ckpt_dir=place), "ckpt_dir", place, why)
    ok = f"/var/tmp/astrai-jobs2-{os.getpid()}"
    jid = c.call("submit", du.spec(model, data, ckpt_dir=os.path.join(ok, "ck")))["job"]
    c.call("cancel", {"job": jid})
    du.wait_job(c, jid, ["cancelled"], pred=lambda j: not j["ranks"])
    shutil.rmtree(ok, ignore_errors=True)
    jid = c.call("submit", du.spec(model, data))["job"]  # the default, in its own run dir
    c.call("cancel", {"job": jid})


def check_shared(c, root, model, data):
    """ckpt_dir of a live job: refused for every spelling; free again once it is final."""
    ck = os.path.join(root, "ck", "a")
    a = c.call("submit", du.spec(model, data, n_epoch=400, ckpt_dir=ck))["job"]
    running_pids(c, a)
    link = os.path.join(root, "ck-link")
    os.symlink(os.path.join(root, "ck"), link)
    for other in [ck, ck + "/", os.path.join(ck, "sub"), os.path.join(root, "ck"),
                  os.path.join(link, "a"), os.path.join(root, "ck", "x", "..", "a")]:
        refused(c, du.spec(model, data, ckpt_dir=other), "ckpt_dir", other, f"job {a}")
    c.call("cancel", {"job": a})
    du.wait_job(c, a, ["cancelled"], pred=lambda j: not j["ranks"])  # its run has ended
    b = c.call("submit", du.spec(model, data, n_epoch=400, ckpt_dir=os.path.join(link, "a")))
    e = du.expect_error(lambda: c.call("resume", {"job": a}), -32002, "ckpt_dir",
                        f"job {b['job']}")
    assert e.data == {"state": "cancelled"}, e.data
    c.call("cancel", {"job": b["job"]})
    return a


def mount_tmpfs(path, *options):
    os.makedirs(path, exist_ok=True)
    opts = ",".join(("size=4m",) + options)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True,
                       text=True)
    return r.returncode == 0, r.stderr.strip()


def check_read_only(d, c, root, model, data):
    """A read-only ckpt_dir is refused at submit; one that turns read-only under a run fails
    the job at once (no restart can write it)."""
    ro = os.path.join(root, "ro")
    ok, why = mount_tmpfs(ro, "ro")
    if not ok:
        print(f"skipped the read-only checks: cannot mount a tmpfs ({why})")
        return
    rw = os.path.join(root, "rw")
    try:
        refused(c, du.spec(model, data, ckpt_dir=os.path.join(ro, "ck")), "ckpt_dir", ro,
                "Read-only file system")
        ok, why = mount_tmpfs(rw)
        assert ok, why
        jid = c.call("submit", du.spec(model, data, n_epoch=12, ckpt_interval=60, max_restarts=3,
                                       ckpt_dir=os.path.join(rw, "ck")))["job"]
        with du.hold(c, jid) as held:  # read-only before its first checkpoint, however fast
            held.advance(du.progress_db(d, jid), to=1)
            r = subprocess.run(["mount", "-o", "remount,ro", rw], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        failed = du.wait_job(c, jid, ["failed"], timeout=180)
        assert failed["restarts"] == 0, f"an unwritable ckpt_dir was retried: {failed}"
        assert "ckpt_dir" in failed["error"] and "Read-only" in failed["error"], failed["error"]
    finally:
        subprocess.run(["umount", "-l", ro])
        subprocess.run(["umount", "-l", rw], capture_output=True)


def part_paths(root, model, data):
    d = daemon(root, "paths", devices="cpu:1")
    with du.guarded(d):
        c = d.client()
        check_inputs(c, root, model, data)
        busy = check_shared(c, root, model, data)
        check_places(d, c, root, model, data, busy)
        check_read_only(d, c, root, model, data)
        c.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- devices

def start_exit(root, devices, env=None):
    """astraid with --devices that must not start: its exit code and stderr."""
    d = du.Daemon(root, devices=devices, env=env)
    p = subprocess.run(d.args, capture_output=True, text=True, timeout=60, env=d.env)
    return p.returncode, p.stderr


def part_devices(root, model, data):
    rc, err = start_exit(os.path.join(root, "cpu0"), "cpu:0")
    assert rc == 2 and "devices" in err, (rc, err)
    lib = os.path.join(os.environ["ASTRAI_BUILD"], "fake_nvml")
    no_gpus = {"LD_LIBRARY_PATH": lib, "FAKE_NVML_FILE": os.path.join(root, "missing")}
    rc, err = start_exit(os.path.join(root, "nogpu"), "cuda:0", no_gpus)
    assert rc == 2 and "cuda:0 names GPU 0, but NVML finds 0 GPU(s)" in err, (rc, err)
    gpus = os.path.join(root, "gpus.txt")
    with open(gpus, "w") as f:
        f.write("%d 0 0 0 Fake one\n%d 0 0 0 Fake two\n" % (1 << 34, 1 << 34))
    two = {"LD_LIBRARY_PATH": lib, "FAKE_NVML_FILE": gpus}
    rc, err = start_exit(os.path.join(root, "gpu5"), "cuda:0,5", two)
    assert rc == 2 and "names GPU 5, but NVML finds 2 GPU(s)" in err, (rc, err)
    d = daemon(root, "gpu1", devices="cuda:1", env=two)
    with du.guarded(d):
        c = d.client()
        assert [x["id"] for x in c.call("daemon.info")["devices"]] == ["cuda:1"]
        c.close()
        assert d.stop() == 0


PARTS = {"interrupt": part_interrupt, "restarts": part_restarts, "paths": part_paths,
         "devices": part_devices}


def main():
    names = sys.argv[1:] or list(PARTS)
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    for name in names:
        t = time.time()
        PARTS[name](root, model, data)
        print(f"{name}: ok ({time.time() - t:.1f} s)")
    print("ok")


if __name__ == "__main__":
    main()
