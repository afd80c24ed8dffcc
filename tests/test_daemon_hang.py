"""astraid's hang watchdog (issue 23 §1): a rank stopped with SIGSTOP (no new optimizer step for
the job's hang_timeout_s) is found hung, its stack is recorded in its log (by gdb, and from
/proc with --gdb=none), the run is stopped and restarted from the last checkpoint, and the job
completes with the same final tensors, bit for bit, as an undisturbed run. A validation pass
longer than hang_timeout_s (a phase the trainer reports) is no hang. hang_timeout_s is
validated."""

import json
import os
import signal
import sqlite3
import struct

import daemon_util as du
import train_util as tu

EPOCHS = 6  # 120 steps on one rank
# hang_timeout_s of the hung jobs: longer than the test holds every rank stopped while it
# brings the job to a known step (a busy machine can stretch that past a second), so that
# only the rank it leaves stopped is the hang.
HANG_S = 4


def tensors(ckpt):
    """Every tensor of the checkpoint's *.safetensors files: {file/name: (dtype, shape, bytes)}."""
    out = {}
    for name in sorted(os.listdir(ckpt)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(ckpt, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header, body = json.loads(f.read(n)), f.read()
        for key, t in header.items():
            if key != "__metadata__":
                a, b = t["data_offsets"]
                out[f"{name}/{key}"] = (t["dtype"], t["shape"], body[a:b])
    assert out, f"no tensors in {ckpt}"
    return out


def final_tensors(status):
    return tensors(tu.latest_checkpoint(status["spec"]["ckpt_dir"]))


def run_log(d, jid, run, rank):
    with open(os.path.join(d.state_dir, "jobs", str(jid), f"run{run}-rank{rank}.log")) as f:
        return f.read()


def hang_and_restart(d, c, spec, stop_rank, reference, stack_mark):
    """Submits spec, stops rank stop_rank with SIGSTOP a step past its first checkpoint (the
    others run on into their collective), and checks the hang's record, the restart and the
    final tensors."""
    jid = c.call("submit", dict(spec, hang_timeout_s=HANG_S))["job"]
    db = du.progress_db(d, jid)
    with du.hold(c, jid) as held:
        du.checkpoint_past(c, d, jid, held)
        step = held.advance(db)  # past the checkpoint's phase: a plain step
        pids = du.rank_pids(d.state_dir, jid)
        for r, pid in enumerate(pids):
            if r != stop_rank:
                os.kill(pid, signal.SIGCONT)
        hung = du.wait_job(c, jid, ["running", "queued", "starting"],
                           pred=lambda j: j["hangs"] == 1)
        assert du.wait_gone(pids, 60), f"ranks {pids} of the hung run survived"
    print(f"job {jid}: rank {stop_rank} stopped after step {step}: hangs {hung['hangs']}")
    (cause,) = du.events(d, jid, "hang")
    print(f"  hang event: {cause}")
    assert f"silent rank: rank {stop_rank} (pid {pids[stop_rank]}, state T: stopped)" in cause, \
        cause
    assert "no new optimizer step" in cause and f"limit {HANG_S} s, hang_timeout_s" in cause, cause
    seen_step = int(cause.split("hang at step ")[1].split(":")[0])
    # The poll may lag a step; with several ranks, the one left stopped may have done its part
    # of the next step's all-reduce before SIGSTOP took it, so the others record that step too.
    last = step + (1 if len(pids) > 1 else 0)
    assert step - 1 <= seen_step <= last, (seen_step, step, last)
    log = run_log(d, jid, 1, stop_rank)
    head = f"astraid: hang at step {seen_step}: stack of rank {stop_rank} (pid {pids[stop_rank]}, "
    assert head + stack_mark[0] + "):" in log, log[-3000:]
    stack = log.split(head, 1)[1]
    assert stack_mark[1] in stack, stack[:3000]
    print(f"  stack recorded ({stack_mark[0]}): {stack_mark[1]!r} found")
    done = du.wait_job(c, jid, ["completed"])
    assert done["restarts"] == 1 and done["hangs"] == 1 and done["error"] is None, done
    assert "resum" in run_log(d, jid, 2, 0).lower(), "run 2 did not resume from the checkpoint"
    got, want = final_tensors(done), final_tensors(reference)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    differ = [k for k in want if got[k] != want[k]]
    assert not differ, f"tensors differ from the undisturbed run's: {differ}"
    print(f"  completed: {len(want)} tensors equal bit for bit to the undisturbed run's")


def check_validation_not_hang(d, c, root):
    """One validation pass of several seconds (a repeated text: many held-out windows) with
    hang_timeout_s 1: no hang, and the pass did last longer than the limit."""
    model = tu.make_model(os.path.join(root, "mv"))
    src = os.path.join(root, "long.txt")
    with open(tu.TEXT, "rb") as f, open(src, "wb") as out:
        out.write(f.read() * 8)
    data = os.path.join(root, "long")
    tu.run([tu.binary("astrai-data"), "prep", "--out", data, "--format", "text", "--tokenizer",
            "bytes", src])
    jid = c.call("submit", du.spec(model, data, val_split=0.97, val_step=100000,
                                   hang_timeout_s=1))["job"]
    seen = du.wait_job(c, jid, ["running", "completed"],
                       pred=lambda j: j["phase"] == "validation" or j["state"] == "completed")
    done = du.wait_job(c, jid, ["completed"])
    db = sqlite3.connect(du.progress_db(d, jid))
    (took,) = db.execute("SELECT v.wall_time - s.wall_time FROM validation v JOIN steps s "
                         "ON s.step = v.step").fetchone()
    db.close()
    print(f"job {jid}: validation took {took:.2f} s (hang_timeout_s 1; phase seen: "
          f"{seen['phase']}): hangs {done['hangs']}, restarts {done['restarts']}")
    assert took > 1, f"the validation took {took} s: too short to test anything"
    assert done["hangs"] == 0 and done["restarts"] == 0 and not du.events(d, jid, "hang"), done


def check_bad_values(c, model, data):
    for v in (0.5, 604801, "3"):
        e = du.expect_error(lambda: c.call("submit", du.spec(model, data, hang_timeout_s=v)),
                            -32602, "hang_timeout_s")
        print(f"hang_timeout_s {v!r}: {e.message}")


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    base = du.spec(model, data, n_epoch=EPOCHS, ckpt_interval=40)
    ddp = dict(base, nprocs=2, parallel_mode="ddp", batch_per_device=2)
    # gdb: one rank
    for sub in ("gdb", "proc"):
        os.makedirs(os.path.join(root, sub))
    d = du.Daemon(os.path.join(root, "gdb"), args=["--stop-timeout=3"], devices="cpu:2").start()
    with du.guarded(d):
        c = d.client()
        check_bad_values(c, model, data)
        reference = du.wait_job(c, c.call("submit", base)["job"], ["completed"])
        hang_and_restart(d, c, base, 0, reference, ("gdb", "#0 "))
        check_validation_not_hang(d, c, root)
        c.close()
        assert d.stop() == 0
    # /proc only (--gdb=none): two ranks, the second stopped, the first waiting for it
    d = du.Daemon(os.path.join(root, "proc"), args=["--stop-timeout=3", "--gdb=none"],
                  devices="cpu:2").start()
    with du.guarded(d):
        c = d.client()
        reference = du.wait_job(c, c.call("submit", ddp)["job"], ["completed"])
        hang_and_restart(d, c, ddp, 1, reference, ("/proc", "state T wchan do_signal_stop"))
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
