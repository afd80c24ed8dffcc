"""astraid with real ranks: submit → running → progress in status → completed with its
checkpoint on disk; watch and logs -f pushes; the checkpoint verb; cancel; two jobs on one
device run one after the other."""

import os
import time

import daemon_util as du
import train_util as tu


def check_submit_to_completed(d, c, model, data):
    job = c.call("submit", du.spec(model, data, n_epoch=6, name="tiny"))
    assert job["state"] == "queued", job
    jid = job["job"]
    watcher = d.client()
    watched = watcher.call("watch", {"job": jid})
    assert [j["id"] for j in watched["jobs"]] == [jid], watched
    follower = d.client()
    follower.call("logs", {"job": jid, "follow": True})
    # Held while looked at: it cannot end meanwhile, however fast the machine.
    progress_db = os.path.join(d.state_dir, "jobs", str(jid), "progress.db")
    with du.hold(c, jid) as held:
        held.advance(progress_db)
        running = du.wait_job(c, jid, ["running"], pred=lambda j: j["step"] > 0)
        assert running["total_steps"] == 120, running  # 80 windows / 4 per step * 6 epochs
        assert running["loss"] is not None and running["loss"] > 0, running
        assert running["devices"] == ["cpu:0"], running
        assert running["name"] == "tiny" and running["submitted_by"] == os.getuid(), running
        info = c.call("daemon.info")
        assert info["devices"] == [{"id": "cpu:0", "busy_job": jid}], info
        # One step or more further, still held: a progress push between the one of the step
        # above and the last one.
        step = held.advance(progress_db)
        du.wait_job(c, jid, ["running"], pred=lambda j: j["step"] >= step)
    done = du.wait_job(c, jid, ["completed"])
    assert done["step"] == 120 and done["error"] is None and done["finished_at"], done
    ckpt = done["last_checkpoint"]
    assert ckpt and ckpt.endswith("epoch_5_step_120") and os.path.isdir(ckpt), done
    assert ckpt.startswith(os.path.join(d.state_dir, "jobs", str(jid), "checkpoints")), ckpt
    rows = tu.metric_rows(ckpt)
    assert len(rows) == 120 and abs(rows[-1]["loss"] - done["loss"]) < 1e-6, (rows[-1], done)
    # watch: progress pushes with growing steps, then the end push
    steps, end = [], None
    while end is None:
        m = watcher.push()
        if m["method"] == "progress":
            steps.append(m["params"]["step"])
        elif m["method"] == "end":
            end = m["params"]
    assert end == {"job": jid, "state": "completed"}, end
    assert steps == sorted(steps) and steps[-1] == 120 and len(set(steps)) > 2, steps
    # logs -f: the rank's stderr lines pushed, then end
    lines = []
    while True:
        m = follower.push()
        if m["method"] == "end":
            break
        assert m["params"]["job"] == jid and m["params"]["rank"] == 0, m
        lines.append(m["params"]["line"])
    assert any("done: 120 optimizer steps" in x for x in lines), lines[-5:]
    run_log = os.path.join(d.state_dir, "jobs", str(jid), "run1-rank0.log")
    with open(run_log) as f:
        assert "done: 120 optimizer steps" in f.read()
    tail = c.call("logs", {"job": jid, "tail": 2})["lines"]
    assert len(tail) == 2 and tail[-1] == lines[-1], (tail, lines[-2:])
    watcher.close()
    follower.close()


def check_checkpoint_and_cancel(d, c, model, data):
    jid = c.call("submit", du.spec(model, data, n_epoch=400))["job"]
    du.wait_job(c, jid, ["running"], pred=lambda j: j["step"] >= 3)
    after = c.call("checkpoint", {"job": jid})
    assert after["state"] == "running", after
    saved = du.wait_job(c, jid, ["running"], pred=lambda j: j["last_checkpoint"] is not None)
    ckpt = saved["last_checkpoint"]
    assert os.path.isfile(os.path.join(ckpt, "meta.json")), ckpt
    du.wait_job(c, jid, ["running"], pred=lambda j: j["step"] > saved["step"] + 2)  # goes on
    pids = du.rank_pids(d.state_dir, jid)
    assert pids and all(du.pid_alive(p) for p in pids), pids
    cancelled = c.call("cancel", {"job": jid})
    assert cancelled["state"] == "cancelled", cancelled
    assert du.wait_gone(pids, 20), f"ranks {pids} survived cancel"
    deadline = time.time() + 20
    while c.call("daemon.info")["devices"][0]["busy_job"] is not None:
        assert time.time() < deadline, "cancel did not free the device"
        time.sleep(0.05)
    assert os.path.isdir(ckpt), "cancel removed the last checkpoint"
    assert c.call("status", {"job": jid})["state"] == "cancelled"


def check_queue_on_one_device(d, c, model, data):
    a = c.call("submit", du.spec(model, data, n_epoch=4, name="a"))["job"]
    b = c.call("submit", du.spec(model, data, n_epoch=4, name="b"))["job"]
    with du.hold(c, a):  # a cannot end before b is looked at
        assert c.call("status", {"job": b})["state"] == "queued"
    ja = du.wait_job(c, a, ["completed"])
    jb = du.wait_job(c, b, ["completed"])
    assert jb["started_at"] >= ja["finished_at"], (ja, jb)
    runs = [j["id"] for j in c.call("list", {"state": "completed"})["jobs"]]
    assert a in runs and b in runs, runs


def main():
    with du.started_with_setup() as (d, c, model, data):
        check_submit_to_completed(d, c, model, data)
        check_checkpoint_and_cancel(d, c, model, data)
        check_queue_on_one_device(d, c, model, data)
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
