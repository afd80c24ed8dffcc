"""astraid's time limit (issue 23 §3): a job with max_duration_hours (scaled down: 0.001 h,
3.6 s) is paused with a checkpoint at the limit, its pause_reason saying so, its
time_left_s 0 and astraictl status showing the time left; resume continues it (its time counted
anew) until it completes, with the same final tensors, bit for bit, as an undisturbed run.
max_duration_hours is validated."""

import subprocess

import daemon_util as du
import train_util as tu
from test_daemon_hang import final_tensors

EPOCHS = 10  # 200 steps
LIMIT_H = 0.001  # 3.6 s of running


def astraictl_status(d, jid):
    p = subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", "status", str(jid)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def check_bad_values(c, model, data):
    for v in (0, 0.00001, 87601, "1"):
        e = du.expect_error(lambda: c.call("submit", du.spec(model, data, max_duration_hours=v)),
                            -32602, "max_duration_hours")
        print(f"max_duration_hours {v!r}: {e.message}")


def first_pause(d, c, jid):
    """Holds the ranks (SIGSTOP) once they made a step, however fast the machine, until astraid
    found the limit reached (the job is pausing); then they checkpoint and exit."""
    db = du.progress_db(d, jid)
    with du.hold(c, jid) as held:
        held.advance(db)
        st = du.wait_job(c, jid, ["running", "pausing"])
        assert 0 <= st["time_left_s"] <= LIMIT_H * 3600, st
        text = astraictl_status(d, jid)
        print(f"astraictl status while running:\n{text}")
        assert "time left " in text and f"(max_duration_hours {LIMIT_H:g})" in text, text
        du.wait_job(c, jid, ["pausing"])
    return du.wait_job(c, jid, ["paused"])


def check_paused(d, paused):
    reason = paused["pause_reason"]
    print(f"paused at step {paused['step']}: {reason}")
    assert reason and f"max_duration_hours {LIMIT_H:g}" in reason, paused
    assert paused["time_left_s"] == 0, paused
    ckpt = paused["last_checkpoint"]
    assert ckpt and ckpt.endswith(f"_step_{paused['step']}"), paused  # saved at the pause
    assert paused["error"] is None, paused


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    base = du.spec(model, data, n_epoch=EPOCHS, ckpt_interval=1000)
    d = du.Daemon(root).start()
    with du.guarded(d):
        c = d.client()
        check_bad_values(c, model, data)
        reference = du.wait_job(c, c.call("submit", base)["job"], ["completed"])
        assert reference["time_left_s"] is None and reference["pause_reason"] is None, reference
        jid = c.call("submit", dict(base, max_duration_hours=LIMIT_H))["job"]
        st = first_pause(d, c, jid)
        pauses = 0
        while st["state"] == "paused":  # each resume runs 3.6 s more
            check_paused(d, st)
            pauses += 1
            assert pauses < 100, st
            st = c.call("resume", {"job": jid})
            assert st["pause_reason"] is None, st
            st = du.wait_job(c, jid, ["paused", "completed"])
        assert st["restarts"] == 0 and st["error"] is None and st["pause_reason"] is None, st
        got, want = final_tensors(st), final_tensors(reference)
        assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), \
            "the time-limited job's final tensors differ from the undisturbed run's"
        print(f"job {jid}: {pauses} pause(s) at the limit, then completed; {len(want)} tensors "
              "equal bit for bit to the undisturbed run's")
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
