"""astraid stopped under a running job. SIGTERM: the ranks checkpoint and exit, astraid exits 0
with the job interrupted; the next astraid resumes it to the same loss curve as a job never
stopped. kill -9: no rank outlives it (PDEATHSIG); the next astraid resumes the job."""

import os
import signal
import sqlite3

import daemon_util as du
import test_launch_util as lu
import train_util as tu

EPOCHS = 12  # 240 steps


def curve(status):
    ckpt = tu.latest_checkpoint(status["spec"]["ckpt_dir"])
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in tu.metric_rows(ckpt)]


def db_state(d, jid):
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=5)
    state = db.execute("SELECT state FROM jobs WHERE id=?", (jid,)).fetchone()[0]
    db.close()
    return state


def stop_mid_job(d, c, model, data, how):
    jid = c.call("submit", du.spec(model, data, n_epoch=EPOCHS))["job"]
    with du.hold(c, jid) as held:  # stopped at step 10, however fast the machine
        held.advance(du.progress_db(d, jid), to=10)
        pids = du.rank_pids(d.state_dir, jid)
        assert pids, "no rank pids recorded"
        if how == "sigterm":
            d.proc.send_signal(signal.SIGTERM)
            # Its ranks are told to stop in the turn that logs it; c's call comes after.
            lu.wait_for("astraid stopping the job",
                        lambda: "stopping 1 running job(s)" in d.logs())
            du.caught_up(c)
        else:
            d.kill9()
            held.wait_signal(signal.SIGTERM)  # PDEATHSIG
    c.close()
    if how == "sigterm":
        assert d.wait() == 0, d.logs()
        assert not any(du.pid_alive(p) for p in pids), "astraid exited before its ranks"
        assert db_state(d, jid) == "interrupted", db_state(d, jid)
    else:
        assert du.wait_gone(pids, 60), f"ranks {pids} survived kill -9 of astraid"
    ckpt_dir = os.path.join(d.state_dir, "jobs", str(jid), "checkpoints")
    assert os.listdir(ckpt_dir), f"{how}: the ranks wrote no checkpoint"
    return jid


def main():
    with du.started_with_setup() as (d, c, model, data):
        reference = du.wait_job(c, c.call("submit", du.spec(model, data, n_epoch=EPOCHS))["job"],
                                ["completed"])
        for how in ("sigterm", "kill9"):
            jid = stop_mid_job(d, c, model, data, how)
            d = du.Daemon(d.root).start()
            c = d.client()
            back = c.call("status", {"job": jid})
            assert back["state"] in ("queued", "starting", "running"), back
            done = du.wait_job(c, jid, ["completed"])
            assert curve(done) == curve(reference), f"{how}: the resumed loss curve differs"
            assert done["loss"] == reference["loss"], (how, done["loss"], reference["loss"])
            assert done["restarts"] == 0, done  # an interruption is not a failure
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
