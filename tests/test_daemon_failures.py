"""A rank killed with SIGKILL: the run is stopped and restarted from the last checkpoint
(also for a 2-rank ddp job, the other rank stopped first) and completes with the loss curve of
an undisturbed job; with max_restarts exhausted the job is failed and its error names the rank
and the signal; a rank that exits 2 (bad input) is failed at once with its message."""

import os
import signal

import daemon_util as du
import train_util as tu

EPOCHS = 12  # 240 steps on one rank


def curve(status):
    ckpt = tu.latest_checkpoint(status["spec"]["ckpt_dir"])
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in tu.metric_rows(ckpt)]


def kill_rank_after_checkpoint(d, c, jid, rank):
    with du.hold(c, jid) as held:  # killed after its first checkpoint, however fast
        du.checkpoint_past(c, d, jid, held)
        pids = du.rank_pids(d.state_dir, jid)
        os.kill(pids[rank], signal.SIGKILL)
    return pids


def check_restart(d, c, model, data, reference, rank, **extra):
    jid = c.call("submit", du.spec(model, data, n_epoch=EPOCHS, ckpt_interval=40, **extra))["job"]
    pids = kill_rank_after_checkpoint(d, c, jid, rank)
    assert du.wait_gone(pids, 30), f"ranks {pids} of the failed run survived"
    done = du.wait_job(c, jid, ["completed"])
    assert done["restarts"] == 1, done
    assert done["error"] is None, done
    assert curve(done) == curve(reference), "the restarted job's loss curve differs"
    with open(os.path.join(d.state_dir, "jobs", str(jid), "run2-rank0.log")) as f:
        assert "resum" in f.read().lower(), "run 2 did not resume from the checkpoint"


def check_exhausted(d, c, model, data):
    jid = c.call("submit", du.spec(model, data, n_epoch=EPOCHS, ckpt_interval=40,
                                   max_restarts=0))["job"]
    pids = kill_rank_after_checkpoint(d, c, jid, 0)
    failed = du.wait_job(c, jid, ["failed"])
    assert f"rank 0 (pid {pids[0]}) was killed by signal 9" in failed["error"], failed["error"]
    assert failed["restarts"] == 0 and failed["finished_at"], failed
    assert os.path.isdir(failed["last_checkpoint"]), failed


def check_bad_input(c, model, data):
    # Paths are checked at submit; a window longer than the model's positions is found by
    # the rank.
    jid = c.call("submit", du.spec(model, data, window_size=64, max_restarts=3))["job"]
    failed = du.wait_job(c, jid, ["failed"])
    assert failed["restarts"] == 0, failed  # exit code 2: restarting cannot help
    assert "exited with code 2" in failed["error"] and "window_size" in failed["error"], \
        failed["error"]


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    d = du.Daemon(root, devices="cpu:2").start()
    with du.guarded(d):
        c = d.client()
        one = du.wait_job(c, c.call("submit", du.spec(model, data, n_epoch=EPOCHS))["job"],
                          ["completed"])
        ddp = {"nprocs": 2, "parallel_mode": "ddp", "batch_per_device": 2}
        two = du.wait_job(c, c.call("submit", du.spec(model, data, n_epoch=EPOCHS, **ddp))["job"],
                          ["completed"])
        check_restart(d, c, model, data, one, 0)
        check_restart(d, c, model, data, two, 1, **ddp)
        check_exhausted(d, c, model, data)
        check_bad_input(c, model, data)
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
