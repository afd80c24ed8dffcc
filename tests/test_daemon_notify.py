"""astraid's notify_command (issue 23 §2): a real program (a script appending what it got to a
file) run on each job event, once: completed, failed, restarted, hang, time_limit, with the
event as its argument and the JOB object on its stdin. A notify command that hangs is killed at
notify_timeout while astraid goes on answering; one that fails is logged."""

import json
import os
import signal
import sys

import daemon_util as du
import test_launch_util as lu
import train_util as tu

RECORDER = """import json, os, sys
job = json.load(sys.stdin)
line = json.dumps({"event": sys.argv[-1], "job": job}) + "\\n"  # the event comes last
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, line.encode())  # one write: lines of notifications at once never mix
"""

# completed: hangs (its pid first written to argv[1]); failed: exits 3.
STUCK = """import os, sys, time
sys.stdin.read()
if sys.argv[-1] == "failed":
    sys.exit(3)
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
time.sleep(3600)
"""

# The state each event leaves its job in.
STATE_AFTER = {"completed": "completed", "failed": "failed", "restarted": "queued",
               "hang": "running", "time_limit": "paused"}


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def notices(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def by_job(path):
    out = {}
    for n in notices(path):
        out.setdefault(n["job"]["id"], []).append(n)
    return out


def wait_notices(path, count):
    return lu.wait_for(f"{count} notices in {path}",
                       lambda: len(notices(path)) >= count and notices(path))


def provoke_events(d, c, model, data):
    """One job per kind of end; returns {job: the events it must have sent, in order}."""
    want = {}
    base = du.spec(model, data, n_epoch=4, ckpt_interval=20)
    jid = c.call("submit", base)["job"]
    du.wait_job(c, jid, ["completed"])
    want[jid] = ["completed"]
    jid = c.call("submit", du.spec(model, data, window_size=64))["job"]  # exit 2: failed at once
    du.wait_job(c, jid, ["failed"])
    want[jid] = ["failed"]
    jid = c.call("submit", base)["job"]  # a rank killed after a checkpoint: restarted
    with du.hold(c, jid) as held:
        du.checkpoint_past(c, d, jid, held)
        os.kill(du.rank_pids(d.state_dir, jid)[0], signal.SIGKILL)
    du.wait_job(c, jid, ["completed"])
    want[jid] = ["restarted", "completed"]
    # stopped: hang, restarted (the limit longer than the holds on the way to the step)
    jid = c.call("submit", dict(base, hang_timeout_s=3))["job"]
    with du.hold(c, jid) as held:
        du.checkpoint_past(c, d, jid, held)
        held.advance(du.progress_db(d, jid))
        pids = du.rank_pids(d.state_dir, jid)
        assert du.wait_gone(pids, 60), "the hung run was not stopped"
    du.wait_job(c, jid, ["completed"])
    want[jid] = ["hang", "restarted", "completed"]
    # paused at its limit: the 1.08 s of running pass while the rank is held (whatever the
    # machine's speed, it can neither finish first nor be at any particular step), then it is
    # let go to take the pause (or is killed after --stop-timeout if it is still starting)
    jid = c.call("submit", dict(base, max_duration_hours=0.0003))["job"]
    with du.hold(c, jid):
        du.wait_job(c, jid, ["pausing", "paused"])
    du.wait_job(c, jid, ["paused"])
    want[jid] = ["time_limit"]
    return want


def check_events(root, model, data):
    out = os.path.join(root, "notices.jsonl")
    script = write(os.path.join(root, "recorder.py"), RECORDER)
    d = du.Daemon(root, args=["--stop-timeout=3",
                              f"--notify-command={sys.executable} '{script}' '{out}'"],
                  devices="cpu:1").start()
    with du.guarded(d):
        c = d.client()
        want = provoke_events(d, c, model, data)
        wait_notices(out, sum(len(v) for v in want.values()))
        c.close()
        assert d.stop() == 0
    got = by_job(out)  # astraid stopped: nothing more comes
    for jid, events in want.items():
        seen = [n["event"] for n in got.get(jid, [])]
        print(f"job {jid}: notified {seen}")
        assert seen == events, f"job {jid}: notices {seen}, expected each of {events} once"
        for n in got[jid]:
            job = n["job"]
            assert job["id"] == jid and job["state"] == STATE_AFTER[n["event"]], n
            if n["event"] == "hang":
                assert job["hangs"] == 1, job
            if n["event"] == "time_limit":
                assert "max_duration_hours" in job["pause_reason"], job
            if n["event"] == "failed":
                assert "window_size" in job["error"], job
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))


def check_stuck(root, model, data):
    """notify_command from the config file: the completed job's notice hangs and is killed at
    notify_timeout (astraid answering meanwhile); the failed one's exits 3: both logged."""
    pid_file = os.path.join(root, "stuck.pid")
    script = write(os.path.join(root, "stuck.py"), STUCK)
    config = write(os.path.join(root, "astraid.json"), json.dumps(
        {"notify_command": f"{sys.executable} {script} {pid_file}", "notify_timeout": 2}))
    d = du.Daemon(root, args=[f"--config={config}"]).start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data, n_epoch=1))["job"]
        du.wait_job(c, jid, ["completed"])
        pid = int(lu.wait_for("the notify command's pid", lambda: os.path.exists(pid_file) and
                              open(pid_file).read()))
        assert du.pid_alive(pid)
        assert c.call("status", {"job": jid})["state"] == "completed"  # answered meanwhile
        lu.wait_for("the hanging notify command killed",
                    lambda: "notify-command (completed) killed after 2 s" in d.logs())
        assert du.wait_gone([pid], 30), f"notify command {pid} survived its bound"
        jid = c.call("submit", du.spec(model, data, window_size=64))["job"]
        du.wait_job(c, jid, ["failed"])
        lu.wait_for("the failing notify command logged",
                    lambda: "notify-command (failed) exited with code 3" in d.logs())
        c.close()
        assert d.stop() == 0
    print("hanging notify command killed at 2 s; failing one logged")


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    for sub in ("events", "stuck"):
        os.makedirs(os.path.join(root, sub))
    check_events(os.path.join(root, "events"), model, data)
    check_stuck(os.path.join(root, "stuck"), model, data)
    print("ok")


if __name__ == "__main__":
    main()
