"""astraictl's streams across a kill -9 and restart of astraid (docs/astraictl.md,
"Reconnecting"): real astraid, real astrai-train ranks, real astraictl processes.

1. A job submitted with `submit --wait`, followed by `watch J`, `logs J -f` and
   `plot J --follow --json`, its ranks held at a step while all four follow it; astraid is
   killed with SIGKILL (its ranks checkpoint and exit: PDEATHSIG) and started again on the same
   state directory and socket. Each client says once on stderr that the connection was lost
   and once that it is back, and ends as it would have without the restart once the job
   completes (exit 0):
   - submit --wait prints `job J queued`, `job J completed`, nothing else;
   - watch ends with the completed JOB, never prints one line twice in a row;
   - logs -f printed exactly the lines of the job's run<N>-rank0.log files, in order: none
     twice, none missing (those of the run before the restart and of the run after it);
   - plot --follow --json holds every row of the job's history, as the history method has it
     after the job completed (each step once: the curve read again after the restart, whose
     run wrote the steps past its checkpoint again).
2. `logs J -f` of a paused job across a kill -9 and restart: astraid's reply then is the log
   files' lines, all printed already: none is printed again; after a resume the new run's
   lines follow, and the output is exactly the log files' lines.
3. `watch J` and `logs J -f` of a job whose astraid comes back without it (its astraid.db
   removed while it was down): exit 1 naming the job ("no such job: J"). `watch J
   --reconnect-timeout 1` meanwhile gives up after a second without astraid: exit 3 saying so.

Every wait is for an event (a line of output, a file, a process's exit, a request counted by
astraid's /metrics), never for a time."""

import json
import math
import os
import shutil
import signal
import subprocess

import daemon_util as du
import test_launch_util as lu
import train_util as tu
from test_daemon_http import http_get
from test_daemon_metrics import parse, value

LOST, BACK = "; reconnecting", "astraictl: reconnected to astraid"
STARTED = []  # every Ctl: none is left running, also when the test fails


class Ctl:
    """astraictl in the background, its stdout and stderr in files."""

    def __init__(self, root, name, d, *args):
        self.name = name
        self.out_path = os.path.join(root, name + ".out")
        self.err_path = os.path.join(root, name + ".err")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([tu.binary("astraictl"), f"--socket={d.socket}"] +
                                         list(args), stdout=out, stderr=err)
        STARTED.append(self)

    def out(self):
        with open(self.out_path) as f:
            return f.read()

    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def finish(self, timeout=180):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} still running {timeout} s on:\n{self.out()[-2000:]}"
                                 f"\n{self.err()[-2000:]}")
        return rc, self.out(), self.err()


def answered(port, method):
    """How many `method` requests astraid answered with a result (its /metrics)."""
    return value(parse(http_get(port, "/metrics")[2].decode()), "astrai_requests_total",
                 method=method, code=0) or 0


def http_daemon(root):
    os.makedirs(root)
    port = tu.free_port()
    return du.Daemon(root, args=[f"--http=127.0.0.1:{port}"]), port


def kill_under(c, d, held, jid):
    """kill -9 of astraid while the job's ranks are held; their pids."""
    pids = du.rank_pids(d.state_dir, jid)
    assert pids, "no rank pids recorded"
    d.kill9()
    held.wait_signal(signal.SIGTERM)  # PDEATHSIG: they checkpoint and exit once released
    c.close()
    return pids


def log_file_lines(d, jid):
    """The non-empty lines of the job's rank 0 logs, run after run (what astraid kept)."""
    run_dir = os.path.join(d.state_dir, "jobs", str(jid))
    runs = sorted(int(f[3:].split("-")[0]) for f in os.listdir(run_dir)
                  if f.startswith("run") and f.endswith("-rank0.log"))
    lines = []
    for n in runs:
        with open(os.path.join(run_dir, f"run{n}-rank0.log"), errors="replace") as f:
            lines += [line for line in f.read().split("\n") if line]
    return runs, lines


def history(c, jid):
    rows, since = [], 0
    while True:
        page = c.call("history", {"job": jid, "since_step": since, "limit": 10000})
        rows += page["steps"]
        if not page["more"]:
            return rows
        since = rows[-1]["step"]


def same_row(a, b):
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isclose(a[k], b[k], rel_tol=1e-14))
        for k in a)


def check_reconnected(ctl, err):
    lost = [line for line in err.splitlines() if line.endswith(LOST)]
    back = [line for line in err.splitlines() if line == BACK]
    assert len(lost) == 1 and len(back) == 1, f"{ctl.name}: stderr {err!r}"


def survive_restart(root, model, data):
    d, port = http_daemon(root)
    d.start()
    job_file = os.path.join(root, "job.json")
    with open(job_file, "w") as f:
        json.dump(du.spec(model, data, n_epoch=4, name="again"), f)  # 80 steps
    with du.guarded(d):
        c = d.client()
        waiter = Ctl(root, "submit-wait", d, "submit", job_file, "--wait")
        first = lu.wait_for("submit's first line", lambda: "\n" in waiter.out() and waiter.out())
        jid = int(first.split()[1])  # "job 1 queued"
        with du.hold(c, jid, pred=lambda j: j["step"] >= 3) as held:
            ctls = [waiter, Ctl(root, "watch", d, "watch", str(jid)),
                    Ctl(root, "logs", d, "logs", str(jid), "-f"),
                    Ctl(root, "plot", d, "plot", str(jid), "--follow", "--json")]
            lu.wait_for("submit --wait, watch, logs -f and plot --follow following the job",
                        lambda: answered(port, "watch") >= 2 and answered(port, "logs") >= 1
                        and answered(port, "history") >= 1)
            lu.wait_for("logs -f and watch printing", lambda: ctls[1].out() and ctls[2].out())
            printed_before = ctls[2].out().count("\n")
            pids = kill_under(c, d, held, jid)
        for ctl in ctls:
            lu.wait_for(f"{ctl.name} saying the connection is lost", lambda: LOST in ctl.err())
        assert du.wait_gone(pids, 60), f"ranks {pids} survived kill -9 of astraid"
    d = du.Daemon(root).start()
    with du.guarded(d):
        c = d.client()
        done = du.wait_job(c, jid, ["completed"], timeout=180)
        results = {ctl.name: ctl.finish() for ctl in ctls}
        for ctl in ctls:
            rc, out, err = results[ctl.name]
            assert rc == 0, f"{ctl.name}: exit {rc}\n{out[-2000:]}\n{err}"
            check_reconnected(ctl, err)

        rc, out, err = results["submit-wait"]
        assert out == f"job {jid} queued\njob {jid} completed\n", out

        rc, out, err = results["watch"]
        lines = out.splitlines()
        repeated = [a for a, b in zip(lines, lines[1:]) if a == b]
        assert not repeated, f"watch printed a line twice in a row: {repeated}"
        assert lines[-1].split()[3] == "completed" and \
            lines[-1].split()[5] == f"{done['total_steps']}/{done['total_steps']}", lines[-1]
        states = [line.split()[3] for line in lines]
        print(f"watch: {len(lines)} lines, states {sorted(set(states))}")

        runs, kept = log_file_lines(d, jid)
        rc, out, err = results["logs"]
        printed = out.split("\n")[:-1]
        assert len(runs) >= 2, f"the job ran once only: runs {runs}"
        first = next((i for i, (a, b) in enumerate(zip(printed, kept)) if a != b),
                     min(len(printed), len(kept)))
        assert printed == kept, (f"logs -f printed {len(printed)} lines, the log files hold "
                                 f"{len(kept)}: first difference at line {first}")
        print(f"logs -f: {len(printed)} lines ({printed_before} before the restart) = runs "
              f"{runs} of the log files")

        rc, out, err = results["plot"]
        got = json.loads(out)
        want = history(c, jid)
        # astraictl prints numbers as cJSON does: the shortest text that reads back within an
        # epsilon, so the last bit of a double may differ
        differ = [(a, b) for a, b in zip(got["steps"], want) if not same_row(a, b)]
        assert got["job"] == jid and len(got["steps"]) == len(want) and not differ, \
            f"plot --json: {len(got['steps'])} rows, history {len(want)}; differ: {differ[:3]}"
        steps = [r["step"] for r in want]
        assert steps == list(range(1, done["total_steps"] + 1)), steps
        print(f"plot --follow --json: {len(steps)} rows = history")
        c.close()
        assert d.stop() == 0


def job_gone(root, model, data):
    d, port = http_daemon(root)
    d.start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data, n_epoch=400, name="gone"))["job"]
        with du.hold(c, jid, pred=lambda j: j["step"] >= 2) as held:
            ctls = [Ctl(root, "gone-watch", d, "watch", str(jid)),
                    Ctl(root, "gone-logs", d, "logs", str(jid), "-f"),
                    Ctl(root, "gone-quick", d, "--reconnect-timeout", "1", "watch", str(jid))]
            lu.wait_for("the clients following the job",
                        lambda: answered(port, "watch") >= 2 and answered(port, "logs") >= 1)
            pids = kill_under(c, d, held, jid)
        rc, out, err = ctls[2].finish()
        assert rc == 3 and "not back within 1 s (--reconnect-timeout)" in err, (rc, err)
        print(f"--reconnect-timeout 1: exit 3, {err.splitlines()[-1]!r}")
        assert du.wait_gone(pids, 60), f"ranks {pids} survived kill -9 of astraid"
        for suffix in ("", "-wal", "-shm"):
            path = os.path.join(d.state_dir, "astraid.db" + suffix)
            if os.path.exists(path):
                os.remove(path)
    d = du.Daemon(root).start()
    with du.guarded(d):
        for ctl in ctls[:2]:
            rc, out, err = ctl.finish()
            assert rc == 1 and f"no such job: {jid}" in err, (ctl.name, rc, err)
            check_reconnected(ctl, err)
            print(f"{ctl.name}: exit 1, {err.splitlines()[-1]!r}")
        assert d.stop() == 0


def paused_job(root, model, data):
    """logs -f of a paused job across the restart: astraid's reply after it is read back from
    the log files, every line of which was printed already: none is printed again; the lines
    of the run after resume follow."""
    os.makedirs(root)
    d = du.Daemon(root).start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data, n_epoch=2, name="paused"))["job"]
        with du.hold(c, jid, pred=lambda j: j["step"] >= 2):
            c.call("pause", {"job": jid})
        du.wait_job(c, jid, ["paused"])
        logs = Ctl(root, "paused-logs", d, "logs", str(jid), "-f")
        _, kept = log_file_lines(d, jid)
        lu.wait_for("logs -f printing the paused job's lines",
                    lambda: logs.out().split("\n")[:-1] == kept)
        d.kill9()
        c.close()
    lu.wait_for("logs -f saying the connection is lost", lambda: LOST in logs.err())
    d = du.Daemon(root).start()
    with du.guarded(d):
        lu.wait_for("logs -f back", lambda: BACK in logs.err())
        c = d.client()
        c.call("resume", {"job": jid})
        du.wait_job(c, jid, ["completed"])
        rc, out, err = logs.finish()
        runs, kept = log_file_lines(d, jid)
        assert rc == 0 and out.split("\n")[:-1] == kept, (rc, out, kept, err)
        check_reconnected(logs, err)
        print(f"paused job: logs -f printed {len(kept)} lines = runs {runs} of the log files")
        c.close()
        assert d.stop() == 0


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    try:
        survive_restart(os.path.join(root, "a"), model, data)
        paused_job(os.path.join(root, "b"), model, data)
        job_gone(os.path.join(root, "c"), model, data)
    finally:
        for ctl in STARTED:
            if ctl.proc.poll() is None:
                ctl.proc.kill()
                ctl.proc.wait()
    shutil.rmtree(root, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
