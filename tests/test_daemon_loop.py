"""astraid's event loop never waits on the disk. A real daemon on a private socket; its ranks
are a stand-in train binary (a shell script that sleeps until killed, or fails at once).

- locked database: while another process holds astraid.db's write lock (BEGIN EXCLUSIVE),
  status, list and daemon.info still answer within 100 ms; a submit and a cancel wait for
  the lock and, past the busy timeout (5 s), get a clear -32603 with nothing changed; with
  the lock released in time the submit gets its reply (before the replies to the requests
  its client sent after it) and its job is in astraid.db;
- slow scan: a run that ends with a ckpt_dir of 100k entries or more (as many as take half a
  second to scan here; its latest checkpoint is looked for there) does not stall status;
- named columns: astraid.db whose jobs table has its columns in another order (another
  version's schema) is read and written by column name."""

import json
import os
import sqlite3
import statistics
import threading
import time

import daemon_util as du
import test_launch_util as lu
import train_util as tu

LATENCY_S = 0.1
BUSY_TIMEOUT_S = 5
POLLER_ROUNDS = 10  # measured while a submit waits for the lock (well within BUSY_TIMEOUT_S)
SCAN_ENTRIES = 100_000        # checkpoint names made at a time ...
SCAN_S = 5 * LATENCY_S        # ... until a scan of them takes this long here
SCAN_MAX = 20 * SCAN_ENTRIES
FAKE_TRAIN = """#!/bin/sh
# A stand-in astrai-train: fails at once, or waits until killed or astraid is gone.
echo "fake rank $RANK start"
[ "$FAKE_MODE" = fail ] && exit 1
while kill -0 "$ASTRAI_LAUNCHER_PID" 2>/dev/null; do sleep 0.1; done
"""


def daemon(root, fake, mode):
    os.makedirs(root, exist_ok=True)
    return du.Daemon(root, args=[f"--train-binary={fake}", "--stop-timeout=1",
                                 "--max-restarts=0"], env={"FAKE_MODE": mode})


def timed(c, method, params=None):
    t0 = time.monotonic()
    c.call(method, params)
    return time.monotonic() - t0


class Poller:
    """A client calling status of job (if given), list and daemon.info in turn in a thread,
    keeping each call's latency, until stopped."""

    def __init__(self, d, job=None):
        self.c, self.lat, self.run = d.client(), [], True
        self.calls = [("list", None), ("daemon.info", None)]
        if job:
            self.calls.append(("status", {"job": job}))
        self.t = threading.Thread(target=self.loop)
        self.t.start()

    def loop(self):
        while self.run:
            for method, params in self.calls:
                self.lat.append((timed(self.c, method, params), method))
            time.sleep(0.01)

    def rounds(self, n):
        """Returns once the poller has made n more rounds of its calls."""
        want = len(self.lat) + n * len(self.calls)
        lu.wait_for(f"{n} rounds of {self.calls}", lambda: len(self.lat) >= want or
                    not self.t.is_alive())

    def stop(self):
        self.run = False
        self.t.join()
        self.c.close()
        return self.lat


def send(c, rid, method, params):
    c.send_raw((json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
                + "\n").encode())


def check_latencies(lat, what):
    worst = max(lat)
    assert worst[0] < LATENCY_S, (
        f"{what}: {worst[1]} took {worst[0] * 1e3:.0f} ms (median "
        f"{statistics.median(x[0] for x in lat) * 1e3:.1f} ms over {len(lat)} calls)")


def lock_db(d):
    """astraid.db's write lock, held by this process until the returned connection
    rolls back."""
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=10,
                         isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    return db


def db_job_ids(d):
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=10)
    ids = [r[0] for r in db.execute("SELECT id FROM jobs ORDER BY id")]
    db.close()
    return ids


def check_locked_db(root, fake, model, data):
    d = daemon(os.path.join(root, "locked"), fake, "sleep").start()
    with du.guarded(d):
        c = d.client()
        running = c.call("submit", du.spec(model, data, name="running"))["job"]
        du.wait_job(c, running, ["running"])
        jobs_before = [j["id"] for j in c.call("list")["jobs"]]

        # Past the busy timeout: the submit and the cancel get an error, nothing changes.
        a, b = d.client(), d.client()
        db = lock_db(d)
        t0 = time.monotonic()
        poller = Poller(d, running)
        send(a, 1, "submit", du.spec(model, data, name="refused"))
        send(b, 1, "cancel", {"job": running})
        du.caught_up(c)  # both read, their writes waiting for the lock
        assert c.call("status", {"job": running})["state"] == "running", \
            "the cancel took effect before it was written"
        replies = [a.reply(), b.reply()]
        waited = time.monotonic() - t0
        check_latencies(poller.stop(), "while astraid.db is locked")
        db.rollback()
        db.close()
        for r in replies:
            assert r.get("error", {}).get("code") == -32603, r
            assert "astraid.db" in r["error"]["message"] and "locked" in \
                r["error"]["message"], r["error"]
        assert waited >= BUSY_TIMEOUT_S - 0.5, f"the error came after {waited:.1f} s"
        assert c.call("status", {"job": running})["state"] == "running"
        assert [j["id"] for j in c.call("list")["jobs"]] == jobs_before, "a refused submit shows"
        assert db_job_ids(d) == jobs_before
        assert sorted(os.listdir(os.path.join(d.state_dir, "jobs"))) == \
            [str(i) for i in jobs_before], "a refused submit left its run directory"

        # Released in time: the submit is answered once written, before what came after it.
        db = lock_db(d)
        poller = Poller(d, running)
        send(a, 2, "submit", du.spec(model, data, name="late"))
        send(a, 3, "status", {"job": running})
        du.caught_up(c)  # the submit read and waiting for the lock, the status behind it
        poller.rounds(POLLER_ROUNDS)
        check_latencies(poller.stop(), "while a submit waits for the lock")
        db.rollback()
        db.close()
        first, second = a.reply(), a.reply()
        assert first["id"] == 2 and second["id"] == 3, (first, second)
        new = first["result"]["job"]
        assert first["result"]["state"] == "queued", first
        assert new in db_job_ids(d), "a submit was answered before its job was written"
        assert c.call("status", {"job": new})["name"] == "late"
        for x in (a, b, c):
            x.close()
    assert d.stop() == 0


def check_slow_scan(root, fake, model, data):
    d = daemon(os.path.join(root, "scan"), fake, "fail").start()
    with du.guarded(d):
        ckpt = os.path.join(root, "crowded")
        os.makedirs(ckpt)
        # Names of checkpoints: each one is looked at (its meta.json) by the search for the
        # latest checkpoint when a run ends. As many as it takes here for their scan to be a
        # stall the latencies would show (on a fast machine, more).
        n, scan_s = 0, 0.0
        while scan_s < SCAN_S and n < SCAN_MAX:
            for i in range(n, n + SCAN_ENTRIES):
                os.close(os.open(os.path.join(ckpt, f"epoch_0_step_{i}"),
                                 os.O_CREAT | os.O_WRONLY))
            n += SCAN_ENTRIES
            t0 = time.monotonic()
            for e in os.scandir(ckpt):
                os.path.isfile(os.path.join(e.path, "meta.json"))
            scan_s = time.monotonic() - t0
        c = d.client()
        poller = Poller(d)
        job = c.call("submit", du.spec(model, data, name="crowded", ckpt_dir=ckpt))["job"]
        du.wait_job(c, job, ["failed"], timeout=60)  # the scan is done before it shows
        poller.rounds(3)
        lat = poller.stop()
        print(f"a scan of {n} entries takes {scan_s * 1e3:.0f} ms here; status max "
              f"{max(lat)[0] * 1e3:.1f} ms")
        check_latencies(lat, f"as a run ended with {n} entries in its ckpt_dir")
        c.close()
    assert d.stop() == 0


def check_named_columns(root, fake, model, data):
    d = daemon(os.path.join(root, "columns"), fake, "sleep").start()
    with du.guarded(d):
        c = d.client()
        job = c.call("submit", du.spec(model, data, name="reordered", priority=3))["job"]
        c.call("pause", {"job": job})
        before = du.wait_job(c, job, ["paused"])
        c.close()
    assert d.stop() == 0
    # Another version's schema: the same columns in reverse order, and one more.
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"))
    info = list(reversed(db.execute("PRAGMA table_info(jobs)").fetchall()))
    rev = [r[1] for r in info]
    defs = [f"{r[1]} {r[2]}{' PRIMARY KEY' if r[5] else ''}" for r in info]
    db.executescript(f"CREATE TABLE jobs2(extra TEXT, {', '.join(defs)}); "
                     f"INSERT INTO jobs2({', '.join(rev)}) SELECT {', '.join(rev)} FROM jobs; "
                     "DROP TABLE jobs; ALTER TABLE jobs2 RENAME TO jobs;")
    db.close()
    d.start()
    with du.guarded(d):
        c = d.client()
        after = c.call("status", {"job": job})
        for k in ("name", "state", "spec", "created_at", "restarts"):
            assert after[k] == before[k], (k, before[k], after[k])
        other = c.call("submit", du.spec(model, data, name="second"))["job"]
        c.call("cancel", {"job": other})
        c.close()
    assert d.stop() == 0
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"))
    row = db.execute("SELECT name, state, priority FROM jobs WHERE id=?", (other,)).fetchone()
    db.close()
    assert row == ("second", "cancelled", 0), row


def main():
    root = tu.tmpdir()
    fake = os.path.join(root, "fake-train")
    with open(fake, "w") as f:
        f.write(FAKE_TRAIN)
    os.chmod(fake, 0o755)
    model, data = du.make_setup(root)
    check_locked_db(root, fake, model, data)
    check_named_columns(root, fake, model, data)
    check_slow_scan(root, fake, model, data)
    print("daemon_loop: ok")


if __name__ == "__main__":
    main()
