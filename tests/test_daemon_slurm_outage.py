"""astraid --executor slurm while Slurm is out of reach (tests/slurm_util.py's one-host
cluster, its slurmctld and munged stopped and started by the test), issue 17 items 1-3:

- cancel during a slurmctld outage: the job is `cancelling` (not final), its ckpt_dir still
  its own; astraid restarted meanwhile asks again; with slurmctld back the Slurm job ends
  and the job is `cancelled`.
- pause during the outage: `pausing` until Slurm takes it (a second pause is refused, the
  first is carried out, also across an astraid restart); a run that reaches its end while
  the pause waits is `completed`.
- failed starts: with munge stopped the tries of a restart come further and further apart
  (read from the events' times), spend no restart and add no run; a refusal Slurm answers
  (the job's partition deleted) fails the job with Slurm's message at once, without
  forgiving its earlier restart.

Skipped with the reason when Slurm cannot run here."""

import contextlib
import os
import signal
import sqlite3
import sys
import time

import daemon_util as du
import slurm_util
import test_launch_util as lu
from test_daemon_slurm import cancel, ddp_spec, held_ranks, slurm_daemon, train_binary_pids, \
    wait_no_slurm_job


def start_daemon(root, cluster, name, extra=()):
    d = slurm_daemon(os.path.join(root, name), cluster, extra)
    os.makedirs(d.root, exist_ok=True)
    return d.start()


def restart(d, c):
    """astraid stopped (SIGTERM: the Slurm jobs live on) and started again; a new client."""
    c.close()
    assert d.stop() == 0, d.logs()
    d.start()
    return d.client()


def wait_log(d, text, timeout=120):
    return lu.wait_for(f"'{text}' in astraid's log", lambda: text in d.logs(), timeout)


def db_rows(d, sql, *args):
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=10)
    rows = db.execute(sql, args).fetchall()
    db.close()
    return rows


def wait_ranks_gone(run_dir, timeout=60):
    lu.wait_for(f"no rank of {run_dir} left", lambda: not train_binary_pids(run_dir), timeout)


def asked_in_outage(d, c, cluster, st, verb, pending, meanwhile):
    """slurmctld stopped, `verb` asked of the job (its status st): it is `pending` while the
    verb's scancel fails; meanwhile() checks what it may then; astraid is restarted (and asks
    again), slurmctld started again. Returns the new client."""
    jid = st["id"]
    cluster.stop_ctld()
    assert c.call(verb, {"job": jid})["state"] == pending
    meanwhile()
    wait_log(d, f"the {verb} is asked again")
    c = restart(d, c)
    assert c.call("status", {"job": jid})["state"] == pending
    wait_log(d, f"tracking Slurm job {st['slurm_job']} again, asking again for its {verb}")
    cluster.start_ctld()
    return c


def cancel_in_outage(root, cluster, model, data):
    """Cancelled once its Slurm job ended, though slurmctld was down when asked and astraid
    restarted meanwhile; its ckpt_dir is its own until then."""
    d = start_daemon(root, cluster, "cancel")
    with du.guarded(d):
        c = d.client()
        spec = ddp_spec(model, data, n_epoch=400)
        jid = c.call("submit", spec)["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        st = du.wait_job(c, jid, ["running"], timeout=120)
        again = dict(spec, ckpt_dir=st["spec"]["ckpt_dir"])

        def ckpt_dir_taken():  # its ranks live on
            du.expect_error(lambda: c.call("submit", again), -32602, "ckpt_dir",
                            f"job {jid} is cancelling")
        with held_ranks(run_dir):  # it cannot end meanwhile, however fast the machine
            c = asked_in_outage(d, c, cluster, st, "cancel", "cancelling", ckpt_dir_taken)
            wait_no_slurm_job(cluster, timeout=120)
        du.wait_job(c, jid, ["cancelled"], timeout=120)
        wait_ranks_gone(run_dir)
        cancel(c, cluster, c.call("submit", again)["job"])  # its ckpt_dir is free now
        c.close()
        assert d.stop() == 0


def pause_in_outage(root, cluster, model, data):
    """Paused once slurmctld is back, though astraid restarted meanwhile; a second pause is
    refused, the first one holds."""
    d = start_daemon(root, cluster, "pause")
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", ddp_spec(model, data, n_epoch=400))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        with held_ranks(run_dir) as held:  # at step 3: it has a step to checkpoint
            held.advance(os.path.join(run_dir, "progress.db"), to=3)
            st = du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["slurm_state"])
            c = asked_in_outage(d, c, cluster, st, "pause", "pausing", lambda: du.expect_error(
                lambda: c.call("pause", {"job": jid}), -32002, "is pausing"))
            held.wait_signal(signal.SIGTERM, timeout=120)  # scancel --signal=TERM's
        paused = du.wait_job(c, jid, ["paused"], timeout=120)
        assert paused["last_checkpoint"], paused
        wait_no_slurm_job(cluster, timeout=120)
        c.close()
        assert d.stop() == 0


def pause_too_late(root, cluster, model, data):
    """A run that reaches its end while its pause waits for Slurm is completed."""
    d = start_daemon(root, cluster, "late")
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", ddp_spec(model, data, n_epoch=1))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        with held_ranks(run_dir) as held:
            held.advance(os.path.join(run_dir, "progress.db"), to=3)
            du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["slurm_state"])
            cluster.stop_ctld()
            assert c.call("pause", {"job": jid})["state"] == "pausing"
        end = du.wait_job(c, jid, ["completed", "paused"], timeout=300)
        assert end["state"] == "completed", end
        assert end["step"] == end["total_steps"], end
        cluster.start_ctld()
        wait_no_slurm_job(cluster, timeout=120)
        c.close()
        assert d.stop() == 0


@contextlib.contextmanager
def frozen(d):
    """astraid stopped (SIGSTOP) in the block: what happens meanwhile it sees only after."""
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        d.proc.send_signal(signal.SIGCONT)


def kill_run(d, cluster, slurm_job, then):
    """The job's Slurm job ends (its step killed: the run failed) while astraid is frozen;
    then() is done once Slurm no longer lists it, before astraid sees the end."""
    with frozen(d):
        cluster.run("scancel", "--signal=KILL", f"{slurm_job}.0")
        wait_no_slurm_job(cluster, timeout=120)
        then()


def start_tries(d, jid, since):
    """The times of the job's starts (its `starting` events) after `since`."""
    return [t for (t,) in db_rows(d, "SELECT time FROM events WHERE job_id=? AND kind='state'"
                                  " AND detail='starting' AND time>? ORDER BY id", jid, since)]


def sbatch_files(d, jid):
    return sorted(f for f in os.listdir(os.path.join(d.shared, "jobs", str(jid)))
                  if f.endswith(".sbatch"))


def with_checkpoint(d, c, model, data):
    """A job running with a checkpoint (the one asked: a restart that saves none has nothing
    to forgive); its status."""
    jid = c.call("submit", ddp_spec(model, data, n_epoch=400, ckpt_interval=10**6))["job"]
    du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["step"] >= 3)
    c.call("checkpoint", {"job": jid})
    return du.wait_job(c, jid, ["running"], timeout=120,
                       pred=lambda j: j["last_checkpoint"] is not None)


def start_backoff(root, cluster, model, data):
    """munge stopped before a restart: its tries fail, further and further apart, and spend
    no restart (one run, one script for all of them)."""
    d = start_daemon(root, cluster, "backoff")
    with du.guarded(d):
        c = d.client()
        st = with_checkpoint(d, c, model, data)
        jid = st["id"]
        since = time.time()
        kill_run(d, cluster, st["slurm_job"], cluster.stop_munge)
        lu.wait_for("6 tries of the restart", lambda: len(start_tries(d, jid, since)) >= 6,
                    timeout=300)
        tries = start_tries(d, jid, since)
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        for k, gap in enumerate(gaps[:5]):
            assert gap >= 0.9 * 2 ** k, f"try {k + 2} came {gap:.1f} s after the last: {gaps}"
        waiting = c.call("status", {"job": jid})
        assert waiting["state"] in ("queued", "starting") and waiting["restarts"] == 1, waiting
        assert db_rows(d, "SELECT count(*) FROM runs WHERE job_id=?", jid) == [(2,)]
        assert sbatch_files(d, jid) == ["run1.sbatch", "run2.sbatch"], sbatch_files(d, jid)
        events = db_rows(d, "SELECT count(*) FROM events WHERE job_id=? AND time>?", jid,
                         since)[0][0]
        assert events <= 4 * len(start_tries(d, jid, since)) + 4, events
        cluster.start_munge()
        st = du.wait_job(c, jid, ["running"], timeout=180,
                         pred=lambda j: j["slurm_job"] not in (None, st["slurm_job"]))
        assert st["restarts"] == 1, st
        cancel(c, cluster, jid)
        c.close()
        assert d.stop() == 0


def start_refused(root, cluster, model, data):
    """The job's partition deleted before its restart: Slurm refuses the start, the job
    fails with Slurm's message, its earlier restart not forgiven."""
    cluster.create_partition("gone")
    d = start_daemon(root, cluster, "refused", ["--slurm-partition=gone"])
    with du.guarded(d):
        c = d.client()
        st = with_checkpoint(d, c, model, data)
        jid = st["id"]
        kill_run(d, cluster, st["slurm_job"], lambda: cluster.delete_partition("gone"))
        failed = du.wait_job(c, jid, ["failed"], timeout=120)
        assert "slurm refuses the job" in failed["error"], failed
        assert "invalid partition" in failed["error"], failed
        assert failed["restarts"] == 1, failed
        assert db_rows(d, "SELECT count(*) FROM runs WHERE job_id=?", jid) == [(2,)]
        assert sbatch_files(d, jid) == ["run1.sbatch", "run2.sbatch"], sbatch_files(d, jid)
        assert "forgiven" not in d.logs(), d.logs()
        c.close()
        assert d.stop() == 0


def run(root, cluster):
    model, data = du.make_setup(root)
    for scenario in (cancel_in_outage, pause_in_outage, pause_too_late, start_backoff,
                     start_refused):
        scenario(root, cluster, model, data)


if __name__ == "__main__":
    sys.exit(slurm_util.main(run))
