"""pause → paused (a checkpoint written, the device free, no rank alive) → resume →
completed with the same loss curve as the same job never paused; pause and resume in the
wrong state are refused with -32002 naming the state."""

import os

import daemon_util as du
import train_util as tu

EPOCHS = 12  # 240 steps


def curve(status):
    ckpt = tu.latest_checkpoint(status["spec"]["ckpt_dir"])
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in tu.metric_rows(ckpt)]


def main():
    with du.started_with_setup() as (d, c, model, data):
        straight = c.call("submit", du.spec(model, data, n_epoch=EPOCHS))["job"]
        reference = du.wait_job(c, straight, ["completed"])
        jid = c.call("submit", du.spec(model, data, n_epoch=EPOCHS))["job"]
        with du.hold(c, jid) as held:  # paused at step 10, however fast the machine
            held.advance(du.progress_db(d, jid), to=10)
            pids = du.rank_pids(d.state_dir, jid)
            pausing = c.call("pause", {"job": jid})
        assert pausing["state"] in ("pausing", "paused"), pausing
        paused = du.wait_job(c, jid, ["paused"])
        assert 10 <= paused["step"] < 240, paused
        ckpt = paused["last_checkpoint"]
        assert ckpt and ckpt.endswith(f"_step_{paused['step']}"), paused
        assert os.path.isfile(os.path.join(ckpt, "meta.json")), ckpt
        assert paused["devices"] == [], paused
        assert c.call("daemon.info")["devices"][0]["busy_job"] is None
        assert du.wait_gone(pids, 5), f"ranks {pids} still alive while paused"
        e = du.expect_error(lambda: c.call("pause", {"job": jid}), -32002, "paused")
        assert e.data == {"state": "paused"}, e.data
        du.expect_error(lambda: c.call("checkpoint", {"job": jid}), -32002, "paused")
        resumed = c.call("resume", {"job": jid})
        assert resumed["state"] in ("queued", "starting", "running"), resumed
        done = du.wait_job(c, jid, ["completed"])
        assert done["step"] == 240, done
        assert curve(done) == curve(reference), "the paused job's loss curve differs"
        assert done["loss"] == reference["loss"], (done["loss"], reference["loss"])
        with open(os.path.join(d.state_dir, "jobs", str(jid), "run2-rank0.log")) as f:
            assert "resum" in f.read().lower(), "run 2 did not resume from the checkpoint"
        du.expect_error(lambda: c.call("pause", {"job": jid}), -32002, "completed")
        du.expect_error(lambda: c.call("resume", {"job": jid}), -32002, "completed")
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
