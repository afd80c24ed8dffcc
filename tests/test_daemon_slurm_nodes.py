"""astraid --executor slurm on a real two-node Slurm cluster, each slurmd inside its own test
host (tests/netns_util.py: network, mount and UTS namespaces; tests/slurm_util.py): both
nodes register idle; sbatch puts one task per node, each with its SLURM_* variables and its
host's /dev/shm; a 2-rank CPU ddp job of "nodes": 2 runs as one Slurm job of one task per
node, its ranks on both hosts, and trains to the end (its loss curve in progress.db and
metric.jsonl); a second one paused, then cancelled: no Slurm job and no rank left on either
host. Skipped (exit 77, with the reason) where Slurm or namespaces are unavailable."""

import contextlib
import os
import sys

import daemon_util as du
import netns_util as nu
import slurm_util
import test_daemon_slurm as ts
import test_launch_util as lu
import train_util as tu

PROBE = """#!/bin/sh
srun --output={out}/probe-%t.out sh -c \
'echo "$(hostname) $SLURM_PROCID $SLURM_NTASKS $SLURM_NODEID $SLURM_LOCALID $(stat -c %d /dev/shm)"'
"""


def sbatch_id(out):
    """The Slurm job id of sbatch's answer ("Submitted batch job 12")."""
    return int(out.stdout.split()[-1])


def probe(root, hosts, cluster):
    """A plain sbatch of 2 nodes, one task each: each task on its node's host, with its
    SLURM_PROCID/NTASKS/NODEID/LOCALID and its host's /dev/shm."""
    script = os.path.join(root, "probe.sh")
    with open(script, "w") as f:
        f.write(PROBE.format(out=root))
    cluster.run("sbatch", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                f"--output={root}/probe-batch.out", script)
    ts.wait_no_slurm_job(cluster)
    for h in hosts:
        shm = h.run(["stat", "-c", "%d", "/dev/shm"], capture_output=True, text=True).stdout
        with open(os.path.join(root, f"probe-{h.index}.out")) as f:
            got = f.read().split()
        assert got == [h.name, str(h.index), "2", str(h.index), "0", shm.strip()], (h.name, got)


def ranks_on(host, run_dir):
    """{SLURM_PROCID: environment} of the job's astrai-train processes inside host."""
    train = os.path.realpath(tu.binary("astrai-train"))
    ranks = {}
    for pid in host.pids():
        try:
            if os.path.realpath(f"/proc/{pid}/exe") != train:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("ASTRAI_RUN_DIR") == run_dir:
            ranks[pid] = env
    return ranks


def held_on_both(hosts, run_dir):
    """The job's two ranks held (lu.Held) once one runs inside each host; checks their
    places (rank k on host k, world 2, MASTER_ADDR host 0's name)."""
    def found():
        per_host = [ranks_on(h, run_dir) for h in hosts]
        return all(len(r) == 1 for r in per_host) and per_host
    per_host = lu.wait_for(f"a rank of {run_dir} in each host", found, timeout=120)
    held = lu.Held([pid for r in per_host for pid in r])
    for h, r in zip(hosts, per_host):
        (env,) = r.values()
        got = (env.get("SLURM_PROCID"), env.get("SLURM_NTASKS"), env.get("SLURMD_NODENAME"),
               env.get("MASTER_ADDR"))
        assert got == (str(h.index), "2", h.name, hosts[0].name), (h.name, got)
    return held


def no_rank_left(hosts, run_dir):
    """Until no astrai-train of the job is left inside any host."""
    lu.wait_for(f"no rank of {run_dir} left", lambda: not any(
        ranks_on(h, run_dir) for h in hosts), timeout=60)


def run(root, hosts, cluster):
    assert cluster.node_states() == {h.name: "idle" for h in hosts}, cluster.node_states()
    probe(root, hosts, cluster)
    model, data = du.make_setup(root)
    d = ts.slurm_daemon(root, cluster)
    d.args = cluster.argv(d.args)  # astraid on host 0, where slurmctld is
    d.start()
    with du.guarded(d):
        c = d.client()
        # One rank per node: sbatch --nodes=2 --ntasks-per-node=1, rank k on host k.
        jid = c.call("submit", ts.ddp_spec(model, data, nodes=2))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        with held_on_both(hosts, run_dir):
            st = du.wait_job(c, jid, ["running"], timeout=120)
            out = cluster.run("scontrol", "--oneliner", "show", "job",
                              str(st["slurm_job"])).stdout
            assert "NumNodes=2 " in out and "NumTasks=2 " in out, out
        with open(os.path.join(run_dir, "run1.sbatch")) as f:
            script = f.read().splitlines()
        for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=2", "#SBATCH --ntasks-per-node=1"):
            assert line in script, (line, script)
        # Trains across the two hosts (needs a cross-host backend: the shm one waits for
        # ever, rank 1 for a segment that rank 0 made in the other host's /dev/shm), to the end.
        du.wait_job(c, jid, ["running", "completed"], timeout=120,
                    pred=lambda j: j["step"] >= 1 or j["state"] == "completed")
        done = du.wait_job(c, jid, ["completed"], timeout=300)
        steps = ts.curve(d.shared, jid)
        assert len(steps) == 60 and done["loss"] == steps[-1][1], (done, steps[-3:])
        assert tu.metric_rows(tu.latest_checkpoint(done["spec"]["ckpt_dir"])), done
        ts.wait_no_slurm_job(cluster)

        # Paused, then cancelled: every rank on every node stops, no Slurm job is left.
        jid = c.call("submit", ts.ddp_spec(model, data, nodes=2, n_epoch=400))["job"]
        run_dir = os.path.join(d.shared, "jobs", str(jid))
        du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["step"] >= 3)
        c.call("pause", {"job": jid})
        paused = du.wait_job(c, jid, ["paused"], timeout=120)
        assert paused["last_checkpoint"], paused
        ts.wait_no_slurm_job(cluster)
        no_rank_left(hosts, run_dir)
        c.call("resume", {"job": jid})
        du.wait_job(c, jid, ["running"], timeout=120, pred=lambda j: j["step"] > paused["step"])
        ts.cancel(c, cluster, jid)
        no_rank_left(hosts, run_dir)
        c.close()
        assert d.stop() == 0


def main():
    root = tu.tmpdir()
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(nu.Hosts(2))
            cluster = stack.enter_context(slurm_util.Cluster(root, hosts=hosts))
        except (nu.Unavailable, slurm_util.Unavailable) as e:
            print(f"skipped: a two-node Slurm cluster cannot run here: {e}")
            return 77
        run(root, hosts, cluster)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
