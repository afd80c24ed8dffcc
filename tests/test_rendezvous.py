"""External launch: processes started by hand (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT),
by SLURM's variables, or by torchrun --no_python meet over TCP and get the same
payload from rank 0; a disagreeing WORLD_SIZE, a missing rank or an unreachable master is
a clear error on every rank, within the timeout. Hostile peers (garbage, a wrong magic, a
hello replayed from another connection, a second claim on a rank) are refused and logged
by rank 0 and never taken for a rank: the meeting goes on with the real ranks."""

import socket
import struct
import subprocess
import sys
import time

import test_launch_util as lu

TIMEOUT_S = 2  # ASTRAI_RENDEZVOUS_TIMEOUT_S of the error cases


def rank(out, r, world, port, timeout_s=20, **extra):
    env = lu.clean_env(RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       ASTRAI_RENDEZVOUS_TIMEOUT_S=timeout_s, **extra)
    return lu.start(out, "--rendezvous", env=env)


def check_same_payload(out, world, root_pid):
    reports = lu.wait_reports(out, world)
    for r, rep in reports.items():
        assert rep["external"] == "1" and rep["world"] == str(world), rep
        assert rep["shm"] == reports[0]["shm"] and rep["nccl_id"] == reports[0]["nccl_id"], rep
    assert reports[0]["shm"].startswith(f"/astrai-{root_pid}-"), reports[0]
    return reports


def test_two_ranks_by_hand(tmp):
    port = lu.free_port()
    # Rank 1 first: it keeps retrying until rank 0 listens (rank 0 starts once rank 1 was
    # refused and sleeps before its next try).
    p1 = rank(tmp, 1, 2, port)
    lu.wait_sleeping(p1.pid)
    p0 = rank(tmp, 0, 2, port)
    for p in (p0, p1):
        rc, err = lu.finish(p)
        assert rc == 0, err
    reports = check_same_payload(tmp, 2, p0.pid)
    assert reports[1]["local_rank"] == "1", reports[1]


def test_slurm_variables(tmp):
    port = lu.free_port()
    procs = []
    for r in range(3):
        env = lu.clean_env(SLURM_PROCID=r, SLURM_NTASKS=3, SLURM_LOCALID=r, SLURM_NODEID=0,
                           SLURM_TASKS_PER_NODE=3, MASTER_ADDR="localhost", MASTER_PORT=port,
                           ASTRAI_RENDEZVOUS_TIMEOUT_S=20)
        procs.append(lu.start(tmp, "--rendezvous", env=env))
    for p in procs:
        rc, err = lu.finish(p)
        assert rc == 0, err
    reports = check_same_payload(tmp, 3, procs[0].pid)
    assert [rep["local_world"] for rep in reports.values()] == ["3"] * 3


def test_stray_connection_is_ignored(tmp):
    port = lu.free_port()
    p0 = rank(tmp, 0, 2, port)
    deadline = time.monotonic() + 10
    while True:  # something that is not a rank talks to rank 0's port first
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)
    p1 = rank(tmp, 1, 2, port)
    for p in (p0, p1):
        rc, err = lu.finish(p)
        assert rc == 0, err
    check_same_payload(tmp, 2, p0.pid)


def expect_failures(procs, want, max_s):
    start = time.monotonic()
    for p in procs:
        rc, err = lu.finish(p)
        assert rc == 1 and want in err, f"want '{want}', rc {rc}, stderr:\n{err}"
    took = time.monotonic() - start
    assert took < max_s, f"took {took:.1f} s"
    return took


def test_wrong_world_size(tmp):
    port = lu.free_port()
    p0 = rank(tmp, 0, 2, port, TIMEOUT_S)
    p1 = rank(tmp, 1, 3, port, TIMEOUT_S)
    # Both hear it as soon as rank 1 says hello, not only at the timeout.
    expect_failures([p0, p1], "says WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2", TIMEOUT_S + 3)


def test_rank_used_twice(tmp):
    """Whichever claim on rank 1 comes second is refused (and told why); the meeting waits on
    for rank 2 and ends at the timeout naming it."""
    port = lu.free_port()
    p0 = rank(tmp, 0, 3, port, TIMEOUT_S)
    p1 = rank(tmp, 1, 3, port, TIMEOUT_S)
    p2 = rank(tmp, 1, 3, port, TIMEOUT_S)
    errs = [lu.finish(p) for p in (p0, p1, p2)]
    assert all(rc == 1 for rc, _ in errs), errs
    taken = [e for _, e in errs[1:] if "rendezvous: rank 1 is already taken (by 127.0.0.1:" in e]
    assert len(taken) == 1, errs
    for _, e in [errs[0]] + [x for x in errs[1:] if x[1] not in taken]:
        assert "only 2 of 3 ranks arrived within" in e and "(missing: rank 2)" in e, errs
    assert "refused a connection from 127.0.0.1:" in errs[0][1], errs[0][1]


MAGIC, VERSION = 0x4153525A, 2


def connect_retry(port, deadline_s=10):
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)


def challenge(s):
    """Rank 0's greeting on a new connection: (magic, version, nonce)."""
    data = b""
    while len(data) < 24:
        chunk = s.recv(24 - len(data))
        assert chunk, "rank 0 closed before its challenge"
        data += chunk
    magic, version = struct.unpack(">II", data[:8])
    return magic, version, data[8:]


def hello(r, world, nonce, ident=b"stranger 0 0"):
    return struct.pack(">6I", MAGIC, VERSION, r, world, 64 + 128, len(ident)) + nonce + ident


def closed(s):
    """Rank 0 closed s without an answer (a reset when our bytes were still unread there)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def refusals(text):
    return [l for l in text.splitlines() if "rendezvous: refused a connection from" in l]


def test_hostile_peers(tmp):
    port = lu.free_port()
    p0 = rank(tmp, 0, 3, port)
    with connect_retry(port) as s:  # garbage
        challenge(s)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 100)
        assert closed(s)
    with connect_retry(port) as s:  # the protocol's shape with a wrong magic
        challenge(s)
        s.sendall(struct.pack(">6I", 0x12345678, VERSION, 1, 3, 192, 0) + b"\0" * 16)
        assert closed(s)
    seen = connect_retry(port)
    _, _, old_nonce = challenge(seen)
    with connect_retry(port) as s:  # a hello answering another connection's challenge
        magic, version, nonce = challenge(s)
        assert (magic, version) == (MAGIC, VERSION) and nonce != old_nonce
        s.sendall(hello(1, 3, old_nonce))
        assert closed(s)
    seen.close()
    with connect_retry(port) as s:  # a valid hello for a rank that is taken: told so
        _, _, nonce = challenge(s)
        s.sendall(hello(0, 3, nonce))
        answer = s.recv(4096)
    assert answer[:8] == struct.pack(">II", MAGIC, 1), answer  # an error reply
    assert b"rank 0 is already taken (by rank 0 itself" in answer, answer
    p1, p2 = rank(tmp, 1, 3, port), rank(tmp, 2, 3, port)
    errs = [lu.finish(p) for p in (p0, p1, p2)]
    assert all(rc == 0 for rc, _ in errs), errs
    got = refusals(errs[0][1])
    assert len(got) == 4, errs[0][1]
    for want, line in zip(("wrong magic", "wrong magic", "replayed or forged",
                           "rank 0 is already taken"), got):
        assert want in line, (want, got)
    check_same_payload(tmp, 3, p0.pid)


def test_missing_rank(tmp):
    port = lu.free_port()
    p0 = rank(tmp, 0, 3, port, TIMEOUT_S)
    p1 = rank(tmp, 1, 3, port, TIMEOUT_S)
    took = expect_failures(
        [p0, p1], f"only 2 of 3 ranks arrived within {TIMEOUT_S} s (missing: rank 2)",
        TIMEOUT_S + 5)
    assert took >= TIMEOUT_S - 0.5, took


def test_unreachable_master(tmp):
    port = lu.free_port()  # nobody listens there
    p1 = rank(tmp, 1, 2, port, TIMEOUT_S)
    took = expect_failures(
        [p1], f"rendezvous: no connection to MASTER_ADDR 127.0.0.1:{port} after {TIMEOUT_S} s",
        TIMEOUT_S + 5)
    assert took >= TIMEOUT_S - 0.5, took


def test_torchrun(tmp):
    """torchrun --no_python: its static rendezvous keeps a store on MASTER_PORT, so the
    ranks meet on MASTER_PORT+1."""
    port = lu.free_port(2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={port}",
           # torch 1.13 under Python 3.11 cannot parse the default "0" of these two
           "--redirects=1", "--tee=1", f"--log_dir={tmp}/logs", "--no_python", lu.PROBE,
           f"--out={tmp}", "--rendezvous"]
    env = lu.clean_env(ASTRAI_RENDEZVOUS_TIMEOUT_S=30, OMP_NUM_THREADS=1)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    reports = lu.wait_reports(tmp, 2)
    for r, rep in reports.items():
        assert rep["external"] == "1" and rep["local_rank"] == str(r), rep
        assert rep["local_world"] == "2", rep
        assert rep["nccl_id"] == reports[0]["nccl_id"] and rep["shm"] == reports[0]["shm"], rep


if __name__ == "__main__":
    lu.run_tests(globals())
