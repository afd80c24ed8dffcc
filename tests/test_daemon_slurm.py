"""astraid --executor slurm on a real one-host Slurm cluster (tests/slurm_util.py): a 2-rank
ddp job runs as one Slurm job of two tasks and completes with the loss curve of the same
job under the local executor; pause/resume gives the never-paused curve; checkpoint writes
one while training goes on; cancel leaves no Slurm job and no rank; a task killed through
Slurm is restarted from the checkpoint; astraid killed -9 and restarted keeps tracking a
running Slurm job; a job Slurm rejects (bad partition) fails at submit with Slurm's message;
slurmctld down is reported at submit and astraid keeps serving; a shared dir with a space
and --slurm-sbatch-args with a quoted value work, an unbalanced quote there exits 2.
Skipped with the reason when Slurm cannot run here."""

import os
import signal
import sqlite3
import sys
import time
import urllib.request

import daemon_util as du
import slurm_util
import test_launch_util as lu
import train_util as tu

EPOCHS = 6  # steps = 6 epochs x 80 windows / (4 per rank x 2 ranks) = 60


def ddp_spec(model, data, **extra):
    s = du.spec(model, data, n_epoch=EPOCHS, nprocs=2, parallel_mode="ddp")
    s.update(extra)
    return s


def curve(state_dir_or_shared, job):
    db = sqlite3.connect(os.path.join(state_dir_or_shared, "jobs", str(job), "progress.db"))
    rows = db.execute("SELECT step, loss, lr, grad_norm FROM steps ORDER BY step").fetchall()
    db.close()
    return rows


def slurm_daemon(root, cluster, extra=(), shared="shared"):
    shared = os.path.join(root, shared)
    d = du.Daemon(root, env={"SLURM_CONF": cluster.conf},
                  args=["--executor=slurm", f"--shared-dir={shared}", "--poll-interval=0.2",
                        *extra])
    d.shared = shared
    return d


def wait_no_slurm_job(cluster, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not cluster.jobs():
            return
        time.sleep(0.2)
    raise AssertionError(f"Slurm still lists {cluster.jobs()}")


def cancel(c, cluster, jid):
    """The job cancelled: once its Slurm job ended, which Slurm then no longer lists."""
    c.call("cancel", {"job": jid})
    du.wait_job(c, jid, ["cancelled"], timeout=120)
    wait_no_slurm_job(cluster)


def kill9_and_restart(d, c, jid, while_down=None):
    """astraid killed -9 (its client closed first), while_down() run, astraid started again;
    returns the new client and the job's status once running."""
    c.close()
    d.kill9()
    if while_down:
        while_down()
    d.start()
    c = d.client()
    return c, du.wait_job(c, jid, ["running"], timeout=60)


def wait_resumed(log, timeout=60):
    """Waits for the run's rank 0 to say it resumed from a checkpoint."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log):
            with open(log) as f:
                if "resuming from" in f.read():
                    return
        time.sleep(0.2)
    raise AssertionError(f"{log}: the run did not resume from the checkpoint")


def held_ranks(run_dir, n=2):
    """The job's n ranks (its astrai-train processes) held, once they run: lu.Held."""
    train = os.path.realpath(tu.binary("astrai-train"))

    def ranks():
        pids = []
        for p in train_binary_pids(run_dir):
            try:
                if os.path.realpath(f"/proc/{p}/exe") == train:
                    pids.append(p)
            except OSError:
                pass
        return len(pids) == n and pids
    return lu.Held(lu.wait_for(f"the {n} ranks of {run_dir}", ranks, timeout=120))


def train_binary_pids(run_dir):
    """Processes whose environment names the run directory (the job's ranks)."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"ASTRAI_RUN_DIR={run_dir}".encode() in f.read().split(b"\0"):
                    pids.append(int(p))
        except OSError:
            pass
    return [p for p in pids if du.pid_alive(p)]


def run_one(d, model, data):
    """d started, one short job run to completion; returns its id and status."""
    os.makedirs(d.root, exist_ok=True)
    d.start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", ddp_spec(model, data, n_epoch=1))["job"]
        done = du.wait_job(c, jid, ["completed"], timeout=300)
        c.close()
        assert d.stop() == 0
    return jid, done


def spaced_shared_dir(root, cluster, model, data):
    """A shared dir with a space (the batch script's #SBATCH --output= names it): the job
    runs, its batch output where the script says."""
    d = slurm_daemon(os.path.join(root, "spaced"), cluster, shared="shared dir")
    jid, _ = run_one(d, model, data)
    assert os.path.exists(os.path.join(d.shared, "jobs", str(jid), "run1-batch.log"))


def quoted_sbatch_args(root, cluster, model, data):
    """--slurm-sbatch-args with a quoted value: sbatch gets it as one word; an unbalanced
    quote is bad config (exit 2 naming the flag)."""
    d = slurm_daemon(os.path.join(root, "quoted"), cluster,
                     ['--slurm-sbatch-args=--comment="two words" --no-requeue'])
    _, done = run_one(d, model, data)
    out = cluster.run("squeue", "--noheader", "--states=all", "--format=%k", "--jobs",
                      str(done["slurm_job"])).stdout
    assert out.strip() == "two words", out
    bad = slurm_daemon(os.path.join(root, "unbalanced"), cluster,
                       ['--slurm-sbatch-args=--comment="two words'])
    os.makedirs(bad.root, exist_ok=True)
    bad.start(wait=False)
    rc = bad.proc.wait(30)
    bad.log.close()
    assert rc == 2 and 'slurm-sbatch-args: unbalanced "' in bad.logs(), (rc, bad.logs())


def run(root, cluster):
    model, data = du.make_setup(root)
    # The reference: the same job under the local executor.
    local = du.Daemon(os.path.join(root, "local"), devices="cpu:2")
    os.makedirs(local.root, exist_ok=True)
    local.start()
    with du.guarded(local):
        c = local.client()
        ref_id = c.call("submit", ddp_spec(model, data))["job"]
        du.wait_job(c, ref_id, ["completed"], timeout=300)
        reference = curve(local.state_dir, ref_id)
        c.close()
        assert local.stop() == 0
    assert len(reference) == 60, len(reference)

    d = slurm_daemon(root, cluster).start()
    with du.guarded(d):
        c = d.client()
        # A job Slurm rejects fails at submit with Slurm's message, and leaves nothing.
        du.expect_error(lambda: c.call("submit", ddp_spec(model, data, nprocs=64)), -32602,
                        "slurm refuses the job", "sbatch")
        assert c.call("list")["jobs"] == [], "a refused job was kept"

        # 2-rank ddp: one Slurm job of two tasks, the local executor's curve.
        jid = c.call("submit", ddp_spec(model, data))["job"]
        st = du.wait_job(c, jid, ["running"], timeout=120)
        assert st["slurm_job"] in cluster.jobs(), (st, cluster.jobs())
        out = cluster.run("scontrol", "--oneliner", "show", "job", str(st["slurm_job"])).stdout
        assert "NumTasks=2" in out, out
        with open(os.path.join(d.shared, "jobs", str(jid), "run1.sbatch")) as f:
            script = f.read()
        for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks=2", "#SBATCH --ntasks-per-node=2",
                     "#SBATCH --no-requeue"):
            assert line in script.splitlines(), (line, script)
        done = du.wait_job(c, jid, ["completed"], timeout=300)
        assert curve(d.shared, jid) == reference, "the Slurm job's loss curve differs"
        assert done["loss"] == reference[-1][1], (done["loss"], reference[-1])
        logs = c.call("logs", {"job": jid, "tail": 1000})["lines"]
        assert any("step" in line.lower() or "epoch" in line.lower() for line in logs), logs
        wait_no_slurm_job(cluster)

        # A pipeline of 2 stages (docs/design.md §13) as one Slurm job of two tasks: the same
        # global batch in one replica gives the ddp curve, to rounding.
        pp = ddp_spec(model, data, parallel_mode="none", pp_size=2,
                      batch_per_device=2 * du.BATCH, grad_accum_steps=1)
        jid = c.call("submit", pp)["job"]
        du.wait_job(c, jid, ["completed"], timeout=300)
        got = curve(d.shared, jid)
        assert len(got) == len(reference) and all(
            abs(a[1] - b[1]) <= 1e-5 * abs(b[1]) for a, b in zip(got, reference)), (got, reference)
        print(f"slurm: a pipeline of 2 stages, {len(got)} steps: the ddp curve (worst "
              f"{max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, reference)):.1e})")
        wait_no_slurm_job(cluster)

        # pause -> paused (every rank checkpointed at one step) -> resume: the same curve.
        jid = c.call("submit", ddp_spec(model, data))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        with held_ranks(run_dir) as held:  # paused at step 5, whatever the machine's speed
            held.advance(os.path.join(run_dir, "progress.db"), to=5)
            du.wait_job(c, jid, ["running"], timeout=120)
            c.call("pause", {"job": jid})
            held.wait_signal(signal.SIGTERM)  # scancel's, off astraid's loop
        paused = du.wait_job(c, jid, ["paused"], timeout=120)
        assert paused["last_checkpoint"], paused
        assert paused["step"] < 60, paused
        wait_no_slurm_job(cluster)
        c.call("resume", {"job": jid})
        done = du.wait_job(c, jid, ["completed"], timeout=300)
        assert curve(d.shared, jid) == reference, "the paused Slurm job's curve differs"

        # checkpoint: one more checkpoint while it trains on. (Cancelled at the end: so many
        # steps that it cannot end before, its ranks held while astraid is down.)
        jid = c.call("submit", ddp_spec(model, data, n_epoch=400))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        st = du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["step"] >= 3)
        c.call("checkpoint", {"job": jid})
        st = du.wait_job(c, jid, ["running"], timeout=120,
                         pred=lambda j: j["last_checkpoint"] is not None)

        # A task killed through Slurm: the run fails and restarts from the checkpoint.
        step_before = st["step"]
        with held_ranks(run_dir):
            cluster.run("scancel", "--signal=KILL", f"{st['slurm_job']}.0")
        again = du.wait_job(c, jid, ["running", "queued", "starting"], timeout=120,
                            pred=lambda j: j["restarts"] == 1 and j["slurm_job"] not in (None, st["slurm_job"]))
        assert "srun exited with code" in again["error"], again

        # astraid killed -9 and started again: it finds the Slurm job and tracks it on.
        du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["step"] > step_before)
        wait_resumed(os.path.join(run_dir, "run2-rank0.log"))
        with held_ranks(run_dir):
            c, st = kill9_and_restart(d, c, jid)
        assert st["slurm_job"] == again["slurm_job"], (st, again)

        # ... also when it died before sbatch's answer reached it (the run open, no Slurm id
        # recorded): it finds the Slurm job by the run's batch script, submits no other.
        def forget_slurm_id():
            db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"))
            db.execute("UPDATE jobs SET slurm_id=0, state='starting' WHERE id=?", (jid,))
            db.commit()
            db.close()

        with held_ranks(run_dir):
            c, st = kill9_and_restart(d, c, jid, while_down=forget_slurm_id)
        assert st["slurm_job"] == again["slurm_job"], (st, again)
        assert cluster.jobs() == [again["slurm_job"]], cluster.jobs()

        # slurmctld down when a run is to be submitted (a restart after a killed task): the
        # job waits in the queue saying why, and runs once slurmctld is back.
        cluster.run("scancel", "--signal=KILL", f"{st['slurm_job']}.0")
        du.wait_job(c, jid, ["queued"], timeout=60, pred=lambda j: j["restarts"] == 2)
        cluster.stop_ctld()
        waiting = du.wait_job(c, jid, ["queued"], timeout=90,
                              pred=lambda j: "sbatch" in (j["error"] or ""))
        assert "contact slurm controller" in waiting["error"], waiting
        assert c.call("status", {"job": jid})["state"] == "queued"
        cluster.start_ctld()
        st = du.wait_job(c, jid, ["running"], timeout=120,
                         pred=lambda j: j["slurm_job"] not in (None, again["slurm_job"]))
        assert st["restarts"] == 2, st

        # cancel: no Slurm job, no rank left.
        cancel(c, cluster, jid)
        deadline = time.time() + 30
        while train_binary_pids(run_dir) and time.time() < deadline:
            time.sleep(0.2)
        assert not train_binary_pids(run_dir), train_binary_pids(run_dir)

        spaced_shared_dir(root, cluster, model, data)
        quoted_sbatch_args(root, cluster, model, data)

        # A partition Slurm does not have: refused at submit with Slurm's message.
        port = tu.free_port()
        bad = slurm_daemon(os.path.join(root, "bad"), cluster,
                           ["--slurm-partition=nopart", f"--http=127.0.0.1:{port}"])
        os.makedirs(bad.root, exist_ok=True)
        bad.start()
        with du.guarded(bad):
            b = bad.client()
            du.expect_error(lambda: b.call("submit", ddp_spec(model, data)), -32602,
                            "slurm refuses the job", "invalid partition")
            # Refused after sbatch answered: the request counts with its answer's code (in
            # the next /metrics: no wait).
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = r.read().decode()
            assert 'astrai_requests_total{method="submit",code="-32602"} 1' in metrics, metrics
            b.close()
            assert bad.stop() == 0

        # No Slurm on PATH: astraid starts, says so, and refuses submits naming sbatch.
        nopath = slurm_daemon(os.path.join(root, "nopath"), cluster)
        nopath.env["PATH"] = "/nonexistent"
        os.makedirs(nopath.root, exist_ok=True)
        nopath.start()
        with du.guarded(nopath):
            b = nopath.client()
            du.expect_error(lambda: b.call("submit", ddp_spec(model, data)), -32602,
                            "slurm refuses the job", "sbatch", "PATH")
            b.close()
            assert nopath.stop() == 0
            assert "sinfo: cannot run it" in nopath.logs(), nopath.logs()

        # slurmctld down: a submit says so, astraid keeps serving.
        cluster.stop_ctld()
        du.expect_error(lambda: c.call("submit", ddp_spec(model, data)), -32602,
                        "slurm refuses the job")
        assert c.call("daemon.info")["version"], "astraid stopped serving"
        c.close()
        assert d.stop() == 0


if __name__ == "__main__":
    sys.exit(slurm_util.main(run))
