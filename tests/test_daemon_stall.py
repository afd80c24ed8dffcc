"""astraid's own stall is no hang of its job (issue 36 item 9): astraid stopped with SIGSTOP (as a
frozen VM or a swap storm would) for longer than a healthy job's hang_timeout_s while the ranks
go on training. Once continued it declares no hang: the watchdog re-reads the ranks' progress
before a verdict and places it by the ranks' own timestamps (a stop shorter than the lateness
bound), and a tick far later than due restarts the hang clocks (a longer stop: logged). A rank
that is really stopped across such a stall is still found hung."""

import os
import signal
import time

import daemon_util as du
import test_launch_util as lu
import train_util as tu

HANG_S = 3  # the job's hang_timeout_s: a step of the tiny model takes far less
LATE_FLOOR_S = 5  # watchdog.c: a tick later than this (10 x the 0.1 s poll interval is less)
LATE_LINE = "astraid's loop was late by "
STEPS = 5  # steps the ranks make alone while astraid is stopped


def newest_step(db):
    return lu.progress_value(db, "SELECT MAX(step) FROM steps") or 0


def steps_since(db, wall):
    """Steps the ranks wrote after unix time wall (whatever run they belong to)."""
    return lu.progress_value(db, f"SELECT COUNT(*) FROM steps WHERE wall_time > {wall!r}") or 0


def stopped_astraid(d, at_least_s, until=lambda: True, meanwhile=lambda: None):
    """Stops astraid with SIGSTOP until at least at_least_s passed since it was seen stopped (a
    lower bound: the test only waits longer on a slow machine) and until() holds; meanwhile() is
    called in between (the wait starts after it). Continued, also on failure. Returns
    meanwhile()'s value and the seconds of the wait."""
    pid = d.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        lu.wait_for(f"astraid (pid {pid}) stopped", lambda: lu.proc_state(pid) == "T", 60, 0.01)
        got = meanwhile()
        t0 = time.monotonic()
        lu.wait_for(f"{at_least_s} s with astraid stopped",
                    lambda: time.monotonic() - t0 > at_least_s and until(), 120)
        return got, time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)


def keeps_its_run(d, c, jid, db, at_least_s):
    """astraid, continued, goes on reading the ranks' steps with no hang: its status shows a
    step the ranks wrote after it continued, three reads in a row, and at least the hang limit
    passed since (a verdict of the stale clocks would be in by then)."""
    t0 = time.monotonic()
    for _ in range(3):
        past = newest_step(db)
        st = du.wait_job(c, jid, ["running", "queued", "starting"],
                         pred=lambda j: j["hangs"] or j["step"] > past)
        assert st["state"] == "running" and st["hangs"] == 0 and st["restarts"] == 0, st
    lu.wait_for(f"{at_least_s} s since astraid continued",
                lambda: time.monotonic() - t0 > at_least_s)
    st = c.call("status", {"job": jid})
    assert st["state"] == "running" and st["hangs"] == 0 and st["restarts"] == 0, st
    assert not du.events(d, jid, "hang"), du.events(d, jid, "hang")
    return st


def stall(d, c, jid, db, at_least_s):
    """astraid stopped for at least at_least_s and until the ranks wrote STEPS more steps: no
    hang. Returns the seconds it was stopped and whether it said its loop was late."""
    late = d.logs().count(LATE_LINE)
    since, before = time.time(), newest_step(db)
    _, took = stopped_astraid(d, at_least_s, lambda: steps_since(db, since) >= STEPS)
    after = newest_step(db)
    st = keeps_its_run(d, c, jid, db, HANG_S)
    late = d.logs().count(LATE_LINE) > late
    print(f"astraid stopped {took:.1f} s (hang_timeout_s {HANG_S}): the ranks went from step "
          f"{before} to {after} meanwhile; no hang, status at step {st['step']}; loop "
          f"{'late: hang clocks restarted' if late else 'not late: re-read before the verdict'}")
    return took, late


def hang_in_stall(d, c, jid, db, held_s):
    """While astraid is stopped the rank trains STEPS steps alone, then is stopped too for at
    least held_s; astraid continued finds the hang. Returns the silence the hang names, the
    seconds the rank was held before astraid continued, and whether the loop said it was
    late."""
    (pid,) = du.rank_pids(d.state_dir, jid)
    hangs, late = c.call("status", {"job": jid})["hangs"], d.logs().count(LATE_LINE)
    since = time.time()
    held, took = stopped_astraid(d, held_s, meanwhile=lambda: (
        lu.wait_for(f"{STEPS} steps of rank 0 (pid {pid})",
                    lambda: steps_since(db, since) >= STEPS), lu.Held([pid]))[1])
    with held:
        st = du.wait_job(c, jid, ["running", "queued", "starting"],
                         pred=lambda j: j["hangs"] > hangs)
    # Its event row commits after the status shows the hang (state.c's writer).
    cause = lu.wait_for(f"hang event {hangs + 1} of job {jid}",
                        lambda: du.events(d, jid, "hang")[hangs:])[0]
    late = d.logs().count(LATE_LINE) > late
    print(f"rank 0 stopped {took:.1f} s inside a stop of astraid (late: {late}): hangs "
          f"{st['hangs']}: {cause}")
    assert st["hangs"] == hangs + 1, st
    assert f"silent rank: rank 0 (pid {pid}, state T: stopped)" in cause, cause
    assert f"limit {HANG_S} s, hang_timeout_s" in cause, cause
    silent_s = float(cause.split("no new optimizer step for ")[1].split(" s")[0])
    return silent_s, took, late


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    # Far more steps than the test can see (it cancels the job), no checkpoint and no progress
    # line meanwhile: the ranks never wait on astraid (its log pipe) while it is stopped.
    spec = du.spec(model, data, n_epoch=100000, ckpt_interval=10**9, log_interval=10**9,
                   hang_timeout_s=HANG_S)
    d = du.Daemon(root, args=["--stop-timeout=3", "--gdb=none"]).start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", spec)["job"]
        db = du.progress_db(d, jid)
        du.running(c, jid, pred=lambda j: j["step"] > 0)
        # Past the limit, mostly under the lateness bound: the re-read before a verdict.
        stall(d, c, jid, db, HANG_S + 0.5)
        # Past the lateness bound: the clocks restart, and astraid says so.
        took, late = stall(d, c, jid, db, LATE_FLOOR_S + 1)
        assert late, f"no '{LATE_LINE}...' logged after a {took:.1f} s stop"
        # A rank really stopped across such a stop is still found hung: its clock restarted,
        # not forgotten.
        (pid,) = du.rank_pids(d.state_dir, jid)
        _, took, late = hang_in_stall(d, c, jid, db, LATE_FLOOR_S + 1)
        assert late, f"no '{LATE_LINE}...' logged after a {took:.1f} s stop"
        # The restarted run (its first steps made while astraid is stopped), its rank stopped
        # past the limit within a stop under the lateness bound: the silence the hang names is
        # the rank's own, from its last step, not from when astraid read it.
        du.running(c, jid, pred=lambda j: j["ranks"][0]["pid"] != pid)
        silent_s, took, late = hang_in_stall(d, c, jid, db, HANG_S + 0.5)
        assert late or silent_s >= round(took, 1), (silent_s, took)
        c.call("cancel", {"job": jid})
        done = du.wait_job(c, jid, ["cancelled"])
        assert done["hangs"] == 2 and len(du.events(d, jid, "hang")) == 2, done
        print(f"cancelled: hangs {done['hangs']} (the two real ones), restarts {done['restarts']}")
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
