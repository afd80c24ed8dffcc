"""The local launcher (`--nprocs N` without rank variables) with real processes and
signals: every rank sees its place; a failing or killed rank stops the others and
gives the launcher its exit code; SIGTERM/SIGINT reach every rank; a rank ignoring
SIGTERM is killed after the grace period; ranks die with their launcher; no process
and no shm segment is left behind; astrai-train's --master_addr/--master_port say where
the ranks meet."""

import os
import signal
import socket
import subprocess
import time

import test_launch_util as lu

LONG = "--sleep-ms=60000"  # ranks that would outlive the test unless stopped


def ranks_pids(reports):
    return [int(r["pid"]) for r in reports.values()]


def test_ranks_see_their_place(tmp):
    proc = lu.start(tmp, "--nprocs=3", "--rendezvous", "--shm")
    rc, err = lu.finish(proc)
    assert rc == 0, err
    reports = lu.wait_reports(tmp, 3)
    shm = reports[0]["shm"]
    assert shm.startswith(f"/astrai-{proc.pid}-"), shm
    cores = len(os.sched_getaffinity(0))
    for r, rep in reports.items():
        assert (rep["rank"], rep["world"], rep["local_rank"], rep["local_world"]) == \
            (str(r), "3", str(r), "3"), rep
        assert rep["external"] == "0" and rep["shm"] == shm, rep
        assert rep["nccl_id"] == reports[0]["nccl_id"] and len(rep["nccl_id"]) == 256, rep
        assert int(rep["threads"]) == max(1, cores // 3), rep
    assert len(set(ranks_pids(reports))) == 3
    lu.wait_gone(ranks_pids(reports), timeout=2)
    assert lu.shm_segments(shm) == [], "the launcher left the ranks' shm segment"


def test_failing_rank_stops_the_others(tmp):
    start = time.monotonic()
    proc = lu.start(tmp, "--nprocs=3", "--exit=1:3", LONG)
    rc, err = lu.finish(proc)
    reports = lu.wait_reports(tmp, 3)
    assert rc == 3, err
    assert f"rank 1 (pid {reports[1]['pid']}) exited with code 3" in err, err
    assert time.monotonic() - start < 20
    for r in (0, 2):
        assert os.path.exists(os.path.join(tmp, f"term{r}")), f"rank {r} got no SIGTERM"
    lu.wait_gone(ranks_pids(reports), timeout=2)


def test_kill9_of_a_rank(tmp):
    proc = lu.start(tmp, "--nprocs=3", "--shm", LONG)
    reports = lu.wait_reports(tmp, 3, proc)
    shm = reports[0]["shm"]
    assert lu.shm_segments(shm), "the ranks made no segment to clean up"
    os.kill(int(reports[2]["pid"]), signal.SIGKILL)
    rc, err = lu.finish(proc)
    assert rc == 128 + signal.SIGKILL, err
    assert f"rank 2 (pid {reports[2]['pid']}) was killed by signal 9" in err, err
    lu.wait_gone(ranks_pids(reports), timeout=2)
    assert lu.shm_segments(shm) == [], "segment of the dead run left in /dev/shm"


def test_stop_signals_are_forwarded(tmp):
    # SIGTERM: each rank records it and exits with its own code, which the launcher returns.
    proc = lu.start(tmp, "--nprocs=2", "--term-code=5", LONG)
    reports = lu.wait_reports(tmp, 2, proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = lu.finish(proc)
    assert rc == 5, err
    for r in (0, 1):
        assert os.path.exists(os.path.join(tmp, f"term{r}")), f"rank {r} got no SIGTERM"
    lu.wait_gone(ranks_pids(reports), timeout=2)
    # SIGINT (Ctrl-C): forwarded as SIGINT; the probe dies of it: 128 + 2.
    sub = os.path.join(tmp, "int")
    os.mkdir(sub)
    proc = lu.start(sub, "--nprocs=2", LONG)
    reports = lu.wait_reports(sub, 2, proc)
    proc.send_signal(signal.SIGINT)
    rc, err = lu.finish(proc)
    assert rc == 128 + signal.SIGINT, err
    lu.wait_gone(ranks_pids(reports), timeout=2)


def test_rank_ignoring_sigterm_is_killed_after_the_grace(tmp):
    proc = lu.start(tmp, "--nprocs=2", "--ignore-term=1", LONG,
                    env=lu.clean_env(ASTRAI_STOP_GRACE_S=1))
    reports = lu.wait_reports(tmp, 2, proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, err = lu.finish(proc)
    took = time.monotonic() - start
    assert rc == 128 + signal.SIGKILL, err
    assert f"rank 1 (pid {reports[1]['pid']}) did not stop within 1 s; SIGKILL" in err, err
    assert os.path.exists(os.path.join(tmp, "term1")), "rank 1 was never asked to stop"
    assert 0.9 <= took < 8, took
    lu.wait_gone(ranks_pids(reports), timeout=2)


def test_ranks_die_with_their_launcher(tmp):
    proc = lu.start(tmp, "--nprocs=2", LONG)
    reports = lu.wait_reports(tmp, 2, proc)
    proc.kill()  # SIGKILL: the launcher cannot forward anything
    proc.wait()
    lu.wait_gone(ranks_pids(reports), timeout=5)
    for r in (0, 1):
        assert os.path.exists(os.path.join(tmp, f"term{r}")), f"rank {r}: no PDEATHSIG SIGTERM"


def test_bad_grace_period(tmp):
    proc = lu.start(tmp, "--nprocs=2", env=lu.clean_env(ASTRAI_STOP_GRACE_S="later"))
    rc, err = lu.finish(proc)
    assert rc == 1 and "ASTRAI_STOP_GRACE_S='later' is not a number of seconds" in err, err
    assert not os.path.exists(os.path.join(tmp, "rank0.txt")), "ranks started anyway"


def test_master_addr_and_port(tmp):
    """astrai-train --nprocs=2 given --master_addr/--master_port: the launcher listens there
    for the ranks' rendezvous. With the port held by another program the launch fails at once
    naming addr:port (exit 1, no rank started); the same port on another loopback address, and
    once freed, is where the ranks meet and train."""
    import train_util as tu  # torch and the reference: only this test needs them
    model = tu.make_model(tmp)
    data, _ = tu.make_text_data(tmp, 3000)
    port = lu.free_port()

    def train(ck, *master):
        args = [tu.binary("astrai-train"), "--train_type=seq", f"--param_path={model}",
                f"--data_root_path={data}", "--window_size=16", f"--ckpt_dir={tmp}/{ck}",
                "--threads=1", "--max_steps=1", "--nprocs=2", "--parallel_mode=ddp",
                f"--master_port={port}", *master]
        env = lu.clean_env(ASTRAI_RENDEZVOUS_TIMEOUT_S=20)
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)

    def trained(proc, ck):
        assert proc.returncode == 0, proc.stderr
        rows = tu.metric_rows(tu.latest_checkpoint(os.path.join(tmp, ck)))
        assert [r["step"] for r in rows] == [1], rows

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        start = time.monotonic()
        proc = train("busy")  # master_addr not given: 127.0.0.1
        assert proc.returncode == 1, proc.stderr
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr, \
            proc.stderr
        assert time.monotonic() - start < 10
        assert not os.path.exists(os.path.join(tmp, "busy")), "ranks started anyway"
        trained(train("other_addr", "--master_addr=127.0.0.2"), "other_addr")
    trained(train("freed"), "freed")


if __name__ == "__main__":
    lu.run_tests(globals())
