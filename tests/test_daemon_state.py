"""astraid's state against its own history and an unlucky operator. A real daemon on a
private socket; its ranks are a stand-in train binary (a shell script that prints three
lines, then fails or sleeps until killed), so that jobs start and end in milliseconds.

- ids: with astraid.db deleted, then emptied, new ids go on past state_dir/jobs/<id>; the
  directories the database does not know are reported (daemon.info, log), left untouched;
- a finished job's logs are read back from its files, also after a restart; the .tmp-*
  directory of a checkpoint write that never finished is removed at startup;
- lock: a second astraid on the same state dir exits 1 naming the first one's pid;
- progress: a running job's progress.db that cannot be read is its progress_error (JOB,
  astraictl status, one log line) until it reads again;
- rank identity: at recovery a recorded pid that is now another process (another astraid's
  rank: same binary, another run directory; a later process: another start time) is left
  alone, while a leftover rank of the job is still killed;
- durability: with the state dir on a full tmpfs, submit and the verbs get an error and
  change nothing; what was acknowledged survives a restart; a device freed meanwhile starts
  no job (its start cannot be recorded) until there is room again; the run's own change made
  meanwhile is in astraid.db once there is room;
- a damaged astraid.db: a page of it overwritten while astraid was down (after a clean stop,
  and beside a WAL after kill -9) makes the next start exit 1 naming astraid.db; a WAL frame
  overwritten is cut by sqlite and astraid starts; a page overwritten under a running astraid
  makes its writes refused from then on (submit gets the error, no job starts, daemon.info
  says so, reads go on), a clean stop still stops the running job's ranks, and the next
  start exits 1;
- history: 2000 finished jobs: every list page stays under the 1 MiB line limit, astraictl
  list/status show them all, rm keeps the ckpt_dir, --keep-finished N and Dd."""

import json
import os
import signal
import sqlite3
import subprocess
import time

import daemon_util as du
import test_launch_util as lu
import train_util as tu

RPC_MAX_LINE = 1 << 20
N_HISTORY = 2000
FAKE_LINES = ["fake rank 0 start", "fake line 1", "fake line 2"]
FAKE_TRAIN = """#!/bin/sh
# A stand-in astrai-train: three output lines, then it fails, or waits until killed, until
# astraid is gone (as a rank's PDEATHSIG would) or until $FAKE_STOP.<job id> exists (exit 1).
echo "fake rank $RANK start"
echo "fake line 1"
echo "fake line 2"
[ "$FAKE_MODE" = fail ] && exit 1
while kill -0 "$ASTRAI_LAUNCHER_PID" 2>/dev/null; do
  [ -n "$FAKE_STOP" ] && [ -e "$FAKE_STOP.${ASTRAI_RUN_DIR##*/}" ] && exit 1
  sleep 0.1
done
"""


def daemon(root, fake, mode="sleep", state_dir=None, args=(), stop_file=None, devices="cpu:1"):
    """stop_file: a rank of job J exits 1 once stop_file.J exists."""
    os.makedirs(root, exist_ok=True)
    extra = [f"--train-binary={fake}", "--stop-timeout=1"] + list(args)
    if state_dir:
        extra.append(f"--state-dir={state_dir}")
    env = {"FAKE_MODE": mode, **({"FAKE_STOP": stop_file} if stop_file else {})}
    d = du.Daemon(root, args=extra, env=env, devices=devices)
    if state_dir:
        d.state_dir = state_dir
    return d


def db_exec(d, sql, *args):
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=5)
    rows = db.execute(sql, args).fetchall()
    db.commit()
    db.close()
    return rows


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def mount_tmpfs(path, size):
    """A small tmpfs at path (the tests run as root); False when mounting is not permitted."""
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def astraictl(d, *args, expect=0):
    return tu.run([tu.binary("astraictl"), f"--socket={d.socket}"] + list(args), expect=expect)[0]


# ---------------------------------------------------------------- ids, logs, stale writes

def check_ids_and_logs(root, fake, model, data):
    d = daemon(root, fake, mode="fail").start()
    with du.guarded(d):
        c = d.client()
        j1 = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        du.wait_job(c, j1, ["failed"])
        assert c.call("logs", {"job": j1})["lines"] == FAKE_LINES
        assert c.call("logs", {"job": j1, "tail": 2})["lines"] == FAKE_LINES[1:]
        run_dir = os.path.join(d.state_dir, "jobs", str(j1))
        stale = os.path.join(run_dir, "checkpoints", ".tmp-epoch_0_step_4-4242")
        complete = os.path.join(run_dir, "checkpoints", "epoch_0_step_2")
        write(os.path.join(stale, "model.safetensors"), b"\0" * (1 << 20))
        write(os.path.join(stale, ".astrai-tmp"), b"astrai: a checkpoint being written\n")
        notes = os.path.join(run_dir, "checkpoints", ".tmp-notes", "todo")  # the user's
        write(notes, b"mine\n")
        write(os.path.join(complete, "meta.json"), b"{}")
        c.close()
        assert d.stop() == 0

        # A restart: the job's lines come from its log file now.
        d.start()
        c = d.client()
        assert c.call("logs", {"job": j1})["lines"] == FAKE_LINES
        assert c.call("logs", {"job": j1, "tail": 1})["lines"] == FAKE_LINES[2:]
        assert not os.path.exists(stale), "the unfinished checkpoint write was not removed"
        assert os.path.isdir(complete), "a complete checkpoint was removed"
        assert os.path.exists(notes), "a user's .tmp-notes/ was removed"
        assert "removed " + stale in d.logs(), "the removal is not logged"
        log_before = read(os.path.join(run_dir, "run1-rank0.log"))
        c.close()
        assert d.stop() == 0

        # astraid.db deleted: job 1's directory is not the next job's.
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(os.path.join(d.state_dir, "astraid.db" + suffix)):
                os.unlink(os.path.join(d.state_dir, "astraid.db" + suffix))
        d.start()
        c = d.client()
        unknown = c.call("daemon.info")["unknown_job_dirs"]
        assert unknown == {"count": 1, "ids": [j1]}, unknown
        assert "unknown to astraid.db" in d.logs()
        j2 = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        assert j2 == j1 + 1, f"new job {j2} after the database was deleted"
        du.wait_job(c, j2, ["failed"])
        assert read(os.path.join(run_dir, "run1-rank0.log")) == log_before
        assert sorted(os.listdir(run_dir)) == ["checkpoints", "run1-rank0.log"]
        c.close()
        assert d.stop() == 0

        # astraid.db emptied.
        for table in ("jobs", "runs", "events"):
            db_exec(d, f"DELETE FROM {table}")
        d.start()
        c = d.client()
        assert c.call("daemon.info")["unknown_job_dirs"]["ids"] == [j1, j2]
        j3 = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        assert j3 == j2 + 1, f"new job {j3} after the database was emptied"
        c.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- one astraid per state dir

def check_lock(root, fake):
    d = daemon(root, fake).start()
    with du.guarded(d):
        other = os.path.join(root, "other.sock")
        p = subprocess.run([tu.binary("astraid"), f"--socket={other}",
                            f"--state-dir={d.state_dir}", "--devices=cpu:1",
                            f"--train-binary={fake}"], capture_output=True, text=True, timeout=10)
        assert p.returncode == 1, f"a second astraid on one state dir: exit {p.returncode}"
        want = f"state dir {d.state_dir} is in use by astraid pid {d.proc.pid}"
        assert want in p.stderr, p.stderr
        assert not os.path.exists(other), "the second astraid listened"
        d.kill9()  # the lock goes with its holder
        d.start()
        assert d.stop() == 0


# ---------------------------------------------------------------- rank identity

def proc_start(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22


def stand_in_rank(fake, run_dir):
    """A process whose argv[0] is the train binary, with ASTRAI_RUN_DIR=run_dir, in its own
    process group as a rank is."""
    env = dict(os.environ, ASTRAI_RUN_DIR=run_dir)
    return subprocess.Popen([fake, "600"], executable="/bin/sleep", env=env,
                            start_new_session=True)


def check_progress_error(root, fake, model, data):
    """A running job's progress.db that cannot be read (here: not a database) is the job's
    progress_error in JOB and astraictl status, logged once; a database that reads again (an
    empty one: no tables yet is no error) clears it. The job keeps running throughout."""
    d = daemon(root, fake).start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data))["job"]
        du.wait_job(c, jid, ["running"])
        db = du.progress_db(d, jid)
        with open(db + ".tmp", "wb") as f:
            f.write(b"this is no sqlite database " * 200)
        os.replace(db + ".tmp", db)
        want = "progress.db: file is not a database"
        job = du.wait_job(c, jid, ["running"], pred=lambda j: j.get("progress_error"))
        assert job["progress_error"] == want, job
        out = subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", "status", str(jid)],
                             capture_output=True, text=True, timeout=30).stdout
        assert want in out, out
        os.remove(db)
        sqlite3.connect(db).close()  # an empty database: it reads (no tables: no news)
        job = du.wait_job(c, jid, ["running"], pred=lambda j: j.get("progress_error") is None)
        logged = d.logs().count(f"job {jid}: {want}")
        assert logged == 1, f"logged {logged} times:\n{d.logs()}"
        print(f"an unreadable progress.db: progress_error {want!r} in JOB and status, logged "
              f"once; cleared when it reads again; the job {job['state']}")
        c.call("cancel", {"job": jid})
        c.close()
        assert d.stop() == 0


def check_rank_identity(root, fake, model, data):
    d = daemon(root, fake, args=["--stop-timeout=2"]).start()
    procs = []
    try:
        with du.guarded(d):
            c = d.client()
            jid = c.call("submit", du.spec(model, data))["job"]
            du.wait_job(c, jid, ["running"])
            (pid,) = du.rank_pids(d.state_dir, jid)
            ((starts,),) = db_exec(d, "SELECT starts FROM runs WHERE job_id=?", jid)
            assert json.loads(starts) == [proc_start(pid)], (starts, proc_start(pid))
            d.kill9()
            assert du.wait_gone([pid], 10)

            run_dir = os.path.join(d.state_dir, "jobs", str(jid))
            other = stand_in_rank(fake, os.path.join(root, "elsewhere", "jobs", str(jid)))
            later = stand_in_rank(fake, run_dir)
            leftover = stand_in_rank(fake, run_dir)
            procs = [other, later, leftover]
            starts = [proc_start(other.pid), proc_start(later.pid) + 1, proc_start(leftover.pid)]
            db_exec(d, "UPDATE runs SET pids=?, starts=? WHERE job_id=?",
                    json.dumps([p.pid for p in procs]), json.dumps(starts), jid)
            d.start()  # recovery waits --stop-timeout for the job's leftover ranks
            assert other.poll() is None, "another astraid's rank (another run dir) was killed"
            assert later.poll() is None, "a process started after the rank was killed"
            assert leftover.wait(10) == -signal.SIGKILL, "the job's leftover rank was not killed"
            assert f"rank pid {leftover.pid} of a previous astraid is still alive" in d.logs()
            c = d.client()
            c.call("cancel", {"job": jid})
            c.close()
            assert d.stop() == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ---------------------------------------------------------------- durability

def fill(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    os.close(fd)


def check_durable(root, fake, model, data):
    mnt = os.path.join(root, "mnt")
    if not mount_tmpfs(mnt, "2m"):
        print("durability: skipped (mount -t tmpfs is not permitted here)")
        return
    try:
        d = daemon(root, fake, state_dir=os.path.join(mnt, "state")).start()
        with du.guarded(d):
            c = d.client()
            running = c.call("submit", du.spec(model, data))["job"]
            du.wait_job(c, running, ["running"])
            queued = c.call("submit", du.spec(model, data))["job"]
            paused = c.call("submit", du.spec(model, data))["job"]
            c.call("pause", {"job": paused})
            filler = os.path.join(mnt, "filler")
            fill(filler)

            for _ in range(20):
                du.expect_error(lambda: c.call("submit", du.spec(model, data)), -32603,
                                "astraid.db")
            assert [j["id"] for j in c.call("list")["jobs"]] == [running, queued, paused]
            for verb, job, state in (("pause", queued, "queued"), ("cancel", queued, "queued"),
                                     ("resume", paused, "paused"),
                                     ("cancel", running, "running")):
                du.expect_error(lambda: c.call(verb, {"job": job}), -32603, "astraid.db")
                got = c.call("status", {"job": job})["state"]
                assert got == state, f"{verb} {job} refused, yet the job is {got}"
            assert all(du.pid_alive(p) for p in du.rank_pids(d.state_dir, running))

            os.unlink(filler)  # room again: the same requests are taken
            extra = c.call("submit", du.spec(model, data))["job"]
            assert c.call("pause", {"job": queued})["state"] == "paused"
            c.close()
            assert d.stop() == 0
            d.start()
            c = d.client()
            states = {j["id"]: j["state"] for j in c.call("list")["jobs"]}
            assert sorted(states) == [running, queued, paused, extra], states
            assert states[queued] == "paused" and states[paused] == "paused", states
            c.call("cancel", {"job": running})
            c.close()
            assert d.stop() == 0
    finally:
        umount(mnt)


# ---------------------------------------------------------------- writes failing under a run

def start_blocked(d, c, model, data, stop_file, break_writes):
    """Job A runs, B waits for a device; once break_writes() made astraid.db refuse writes,
    A's rank exits (its run's own change: failed) and frees the device, and B must not start:
    its start could not be recorded. Returns (A, B)."""
    a = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
    du.wait_job(c, a, ["running"])
    b = c.call("submit", du.spec(model, data))["job"]
    a_pids = du.rank_pids(d.state_dir, a)
    break_writes()
    write(f"{stop_file}.{a}")
    assert du.wait_gone(a_pids, 60), "job A's rank did not exit"
    os.unlink(f"{stop_file}.{a}")
    du.wait_job(c, a, ["failed"])
    # A refused write completes after every write queued before it: a start of B when A's
    # end freed the device would be shown by now.
    du.expect_error(lambda: c.call("submit", du.spec(model, data)), -32603, "astraid.db")
    st = json.loads(astraictl(d, "--json", "status", str(b)))
    assert st["state"] == "queued", f"job {b} is {st['state']}: started, yet not recorded"
    return a, b


def check_full_disk_start(root, fake, model, data):
    mnt = os.path.join(root, "mnt")
    if not mount_tmpfs(mnt, "2m"):
        print("full disk start: skipped (mount -t tmpfs is not permitted here)")
        return
    stop_file = os.path.join(root, "stop")
    filler = os.path.join(mnt, "filler")
    try:
        d = daemon(root, fake, state_dir=os.path.join(mnt, "state"), stop_file=stop_file)
        d.start()
        with du.guarded(d):
            c = d.client()
            a, b = start_blocked(d, c, model, data, stop_file, lambda: fill(filler))
            err = c.call("status", {"job": b}).get("error") or ""
            assert "astraid.db" in err, f"job {b} waits, its error does not say why: {err!r}"
            os.unlink(filler)  # room again: B starts, A's end is written
            du.wait_job(c, b, ["running"], timeout=180)
            def row_state(job):
                return db_exec(d, "SELECT state FROM jobs WHERE id=?", job)[0][0]
            assert row_state(b) == "running", row_state(b)
            lu.wait_for(f"job {a}'s end in astraid.db", lambda: row_state(a) == "failed",
                        timeout=180)
            c.close()
            assert d.stop() == 0
            d.start()
            c = d.client()
            assert c.call("status", {"job": a})["state"] == "failed"
            c.call("cancel", {"job": b})
            c.close()
            assert d.stop() == 0
    finally:
        umount(mnt)


# ---------------------------------------------------------------- a damaged astraid.db

def table_page(d, table):
    """(the root page of table in astraid.db, the page size)."""
    ((size,),) = db_exec(d, "PRAGMA page_size")
    ((page,),) = db_exec(d, "SELECT rootpage FROM sqlite_master WHERE name=?", table)
    return page, size


def overwrite_page(path, page, size, data=None):
    """Writes data (default: bytes no b-tree page starts with) over page `page` (from 1) of
    the file; returns what was there."""
    with open(path, "r+b") as f:
        f.seek((page - 1) * size)
        old = f.read(size)
        f.seek((page - 1) * size)
        f.write(data if data is not None else b"\xa5" * size)
    return old


def expect_refused_start(d, db):
    """astraid started on a damaged astraid.db exits 1, naming it."""
    logged = len(d.logs())
    d.start(wait=False)
    rc = d.wait(60)
    said = d.logs()[logged:]
    assert rc == 1, f"astraid exited {rc} on a damaged astraid.db:\n{said}"
    assert f"{db} is damaged" in said, said


def check_damaged_at_start(root, fake, model, data):
    d = daemon(root, fake, mode="fail").start()
    db = os.path.join(d.state_dir, "astraid.db")
    with du.guarded(d):
        c = d.client()
        j = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        du.wait_job(c, j, ["failed"])
        c.close()
        page, size = table_page(d, "events")  # a table astraid does not read at start
        assert d.stop() == 0
        assert not os.path.exists(db + "-wal"), "a clean stop left a WAL"

        good = overwrite_page(db, page, size)  # while astraid was down
        expect_refused_start(d, db)
        overwrite_page(db, page, size, good)
        d.start()  # the page restored: the same file is taken

        # Beside a WAL (astraid killed): a page of the main file that no WAL frame replaces.
        db_exec(d, "PRAGMA user_version=7")  # a frame of page 1 only
        d.kill9()
        assert os.path.getsize(db + "-wal") > 0, "no WAL after kill -9"
        wal = read(db + "-wal")
        overwrite_page(db, page, size)
        expect_refused_start(d, db)
        assert read(db + "-wal") == wal, "the refused start changed the WAL"
        overwrite_page(db, page, size, good)

        # A WAL frame overwritten: its checksum fails, sqlite cuts the WAL there (the commits
        # before it stay) and the database is whole: astraid starts.
        with open(db + "-wal", "r+b") as f:
            f.seek(32 + 24 + 100)  # into the page of the first frame
            f.write(b"\xa5" * 64)
        d.start()
        c = d.client()
        assert c.call("status", {"job": j})["state"] == "failed"
        c.close()
        assert d.stop() == 0


def check_damaged_while_running(root, fake, model, data):
    stop_file = os.path.join(root, "stop")
    d = daemon(root, fake, stop_file=stop_file, devices="cpu:2").start()
    db = os.path.join(d.state_dir, "astraid.db")
    with du.guarded(d):
        c = d.client()
        other = c.call("submit", du.spec(model, data))["job"]  # runs on through the damage
        du.wait_job(c, other, ["running"])
        other_pids = du.rank_pids(d.state_dir, other)

        def damage():
            page, size = table_page(d, "jobs")
            ((busy, _, _),) = db_exec(d, "PRAGMA wal_checkpoint(TRUNCATE)")
            assert busy == 0, "astraid.db's WAL could not be checkpointed"
            overwrite_page(db, page, size)
            db_exec(d, "PRAGMA user_version=7")  # a commit: astraid reads the file again
            du.expect_error(lambda: c.call("submit", du.spec(model, data)), -32603,
                            "astraid.db", "malformed")

        a, b = start_blocked(d, c, model, data, stop_file, damage)
        info = c.call("daemon.info")
        assert info.get("database", "").startswith("damaged ("), info.get("database")
        assert "malformed" in info["database"], info["database"]
        assert "astraid.db is damaged" in d.logs()
        # Reads go on; a state change is refused, the job left as it was.
        assert [j["id"] for j in c.call("list")["jobs"]] == [other, a, b]
        du.expect_error(lambda: c.call("cancel", {"job": other}), -32603,
                        "astraid.db is damaged")
        assert c.call("status", {"job": other})["state"] == "running"
        assert all(du.pid_alive(p) for p in other_pids), "the running job's ranks died"
        c.close()
        assert d.stop() == 0  # its ranks stopped as at any stop
        assert du.wait_gone(other_pids, 30), "ranks outlived astraid"
        expect_refused_start(d, db)


# ---------------------------------------------------------------- history

def call_many(c, method, params_list, batch=100):
    """Pipelined requests, `batch` at a time; their results in order."""
    results = []
    for i in range(0, len(params_list), batch):
        first, lines = c.next_id, []
        for p in params_list[i:i + batch]:
            lines.append(json.dumps({"jsonrpc": "2.0", "id": c.next_id, "method": method,
                                     "params": p}))
            c.next_id += 1
        c.send_raw(("\n".join(lines) + "\n").encode())
        for k in range(len(lines)):
            msg = c.reply()
            assert msg.get("id") == first + k and "result" in msg, msg
            results.append(msg["result"])
    return results


def raw_call(c, method, params):
    """(length of the reply line, the reply)."""
    rid = c.next_id
    c.next_id += 1
    c.send_raw((json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
                + "\n").encode())
    while True:
        line = c.read_line()
        msg = json.loads(line)
        if msg.get("id") == rid:
            return len(line), msg


def all_jobs(c, **params):
    """Every page of list; asserts each reply line is under the limit and the cursors."""
    jobs, after = [], 0
    while True:
        n, msg = raw_call(c, "list", dict(params, **({"after": after} if after else {})))
        assert n < RPC_MAX_LINE, f"a list reply of {n} bytes"
        page = msg["result"]
        jobs += page["jobs"]
        if page["next"] is None:
            return jobs
        assert page["jobs"] and page["next"] == page["jobs"][-1]["id"], page["next"]
        after = page["next"]


def check_history(root, fake, model, data):
    mnt = os.path.join(root, "mnt")
    on_tmpfs = mount_tmpfs(mnt, "256m")  # thousands of commits: no fsync wait
    try:
        d = daemon(root, fake, state_dir=os.path.join(mnt, "state")).start()
        with du.guarded(d):
            history(d, model, data)
    finally:
        if on_tmpfs:
            umount(mnt)


def history(d, model, data):
    c = d.client()
    first = c.call("submit", du.spec(model, data))["job"]
    du.wait_job(c, first, ["running"])  # the one device: the others stay queued
    ids = []
    for _ in range(N_HISTORY // 100):  # few live jobs at a time: submit compares ckpt_dirs
        batch = [r["job"] for r in call_many(c, "submit", [du.spec(model, data)] * 100)]
        call_many(c, "cancel", [{"job": j} for j in batch])
        ids += batch

    jobs = all_jobs(c)
    assert [j["id"] for j in jobs] == [first] + ids
    assert len(c.call("list")["jobs"]) == 100
    n, big = raw_call(c, "list", {"limit": 1000})
    assert n < RPC_MAX_LINE and big["result"]["next"] is not None, n
    assert [j["id"] for j in all_jobs(c, state="running")] == [first]
    assert len(all_jobs(c, state="cancelled", limit=1000)) == N_HISTORY
    for bad in ({"limit": 0}, {"limit": 1001}, {"after": -1}, {"after": 1.5}):
        du.expect_error(lambda: c.call("list", bad), -32602)
    n, _ = raw_call(c, "watch", {})
    assert n < RPC_MAX_LINE, f"a watch reply of {n} bytes"
    c.close()
    c = d.client()

    for args in (["list"], ["status"]):
        rows = astraictl(d, *args).splitlines()
        assert rows[0].split()[0] == "ID" and len(rows) == 1 + 1 + N_HISTORY, len(rows)
        assert [int(r.split()[0]) for r in rows[1:]] == [first] + ids
    assert len(json.loads(astraictl(d, "list", "--json"))["jobs"]) == 1 + N_HISTORY

    # rm: the state and the run directory go, the ckpt_dir stays.
    victim = ids[0]
    run_dir = os.path.join(d.state_dir, "jobs", str(victim))
    kept = os.path.join(run_dir, "checkpoints", "epoch_0_step_1", "meta.json")
    write(kept)
    write(os.path.join(run_dir, "run1-rank0.log"))
    assert c.call("rm", {"job": victim}) == {"job": victim, "removed": True,
                                             "ckpt_dir": os.path.dirname(os.path.dirname(kept))}
    du.expect_error(lambda: c.call("status", {"job": victim}), -32001)
    lu.wait_for("the removed job's log file is gone",
                lambda: not os.path.exists(os.path.join(run_dir, "run1-rank0.log")))
    assert os.listdir(run_dir) == ["checkpoints"] and os.path.exists(kept)
    du.expect_error(lambda: c.call("rm", {"job": first}), -32002, "running")
    du.expect_error(lambda: c.call("rm", {"job": 10 ** 9}), -32001)
    assert "removed" in astraictl(d, "rm", str(ids[1]))
    astraictl(d, "rm", str(first), expect=1)
    assert [j["id"] for j in all_jobs(c)] == [first] + ids[2:]
    c.close()
    assert d.stop() == 0

    # --keep-finished N at startup, then after each job that ends.
    d.args.append("--keep-finished=10")
    d.start()
    c = d.client()
    assert c.call("daemon.info")["unknown_job_dirs"]["ids"] == [victim]
    finished = [j["id"] for j in all_jobs(c) if j["state"] == "cancelled"]
    assert finished == ids[-10:], finished
    c.call("cancel", {"job": first})
    lu.wait_for("the oldest finished job goes when another ends",
                lambda: [j["id"] for j in all_jobs(c)] == [first] + ids[-9:])
    c.close()
    assert d.stop() == 0

    # --keep-finished Dd: jobs finished more than D days ago go. The wait is the retention's
    # own: past it, whatever the machine's speed (a slower one only waits more).
    d.args.append("--keep-finished=0.00001d")  # 0.864 s
    time.sleep(1)
    d.start()
    c = d.client()
    assert all_jobs(c) == [], "finished jobs older than the retention are kept"
    c.close()
    assert d.stop() == 0
    p = subprocess.run(d.args[:-1] + ["--keep-finished=7x"], capture_output=True, text=True,
                       timeout=10)
    assert p.returncode == 2 and "keep-finished" in p.stderr, (p.returncode, p.stderr)


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    fake = os.path.join(root, "fake-train")
    with open(fake, "w") as f:
        f.write(FAKE_TRAIN)
    os.chmod(fake, 0o755)
    check_lock(os.path.join(root, "lock"), fake)
    check_ids_and_logs(os.path.join(root, "ids"), fake, model, data)
    check_rank_identity(os.path.join(root, "identity"), fake, model, data)
    check_progress_error(os.path.join(root, "progress-error"), fake, model, data)
    check_durable(os.path.join(root, "durable"), fake, model, data)
    check_full_disk_start(os.path.join(root, "full-start"), fake, model, data)
    check_damaged_at_start(os.path.join(root, "damaged-start"), fake, model, data)
    check_damaged_while_running(os.path.join(root, "damaged-run"), fake, model, data)
    check_history(os.path.join(root, "history"), fake, model, data)
    print("ok")


if __name__ == "__main__":
    main()
