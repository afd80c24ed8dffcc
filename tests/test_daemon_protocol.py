"""The protocol under hostile input and hostile clients, over astraid's real sockets:
replies that stay valid UTF-8 whatever a rank prints; watch, logs -f and submit --wait that
follow a job through pause and resume and end when it is final (also when it already is);
one default socket for astraid and astraictl; ids echoed as sent, NULs and raw control bytes
refused; astraid linking no training library (BLAS, oneDNN, CUDA, OpenMP); memory bounded
against clients that do not read, with daemon.info answered within
a second throughout; TCP peers that cannot lock unix users out."""

import json
import os
import random
import select
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time

import daemon_util as du
import test_launch_util as lu
import train_util as tu
from test_daemon_http import http_get
from test_daemon_metrics import parse, value

SANITIZED = os.environ.get("ASTRAI_SANITIZED") in ("1", "ON", "TRUE", "true")
RSS_GROWTH = 96 << 20  # astraid's RSS growth under the flood: 64 MiB of client memory, plus slack
LATENCY_BOUND = 3.0 if SANITIZED else 1.0  # seconds for daemon.info (ASan runs 2-5x slower)


class StrictClient(du.Client):
    """A client that keeps every line it gets as sent and decodes it as strict UTF-8
    before parsing it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.raw = []

    def read_message(self):
        line = self.read_line()
        self.raw.append(line)
        return json.loads(line.decode("utf-8", errors="strict"))


def write_script(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def ctl(d, *args, timeout=60, **kw):
    return subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}"] + list(args),
                          capture_output=True, text=True, timeout=timeout, **kw)


def ctl_bg(d, *args):
    return subprocess.Popen([tu.binary("astraictl"), f"--socket={d.socket}"] + list(args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p, timeout):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{p.args[2:]} still running {timeout} s after the job ended:\n"
                             f"{out[-2000:]}\n{err[-2000:]}")
    return p.returncode, out, err


# ---------------------------------------------------------------- 11: valid UTF-8 replies

BAD_RANK = """#!/bin/sh
# Prints once $0.go exists (the test's followers listen by then), then fails.
while [ ! -e "$0.go" ]; do sleep 0.05; done
printf 'data file \\377\\376.bin: cannot open\\n' >&2
printf 'caf\\303\\251 ok, then cut \\342\\202\\n'
exit 1
"""


def check_utf8(root, model, data):
    rank = write_script(os.path.join(root, "bad_rank"), BAD_RANK)
    d = du.Daemon(os.path.join(root, "utf8"), args=[f"--train-binary={rank}"])
    os.makedirs(d.root)
    d.start()
    with du.guarded(d):
        c = StrictClient(d.socket)
        jid = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        follower = StrictClient(d.socket)
        follower.call("logs", {"job": jid, "follow": True})
        watcher = StrictClient(d.socket)
        watcher.call("watch", {"job": jid})
        open(rank + ".go", "w").close()
        job = du.wait_job(c, jid, ["failed"])
        assert "\ufffd\ufffd.bin: cannot open" in job["error"], job["error"]
        assert "caf\u00e9 ok, then cut \ufffd\ufffd" in job["error"], job["error"]
        lines = c.call("logs", {"job": jid})["lines"]
        assert "data file \ufffd\ufffd.bin: cannot open" in lines, lines
        assert "caf\u00e9 ok, then cut \ufffd\ufffd" in lines, lines
        assert any(j["id"] == jid and j["error"] for j in c.call("list")["jobs"])
        pushed = []
        while True:  # the follower's log pushes, then its end push
            m = follower.push(timeout=30)
            if m["method"] == "end":
                break
            pushed.append(m["params"]["line"])
        assert "data file \ufffd\ufffd.bin: cannot open" in pushed, pushed
        while watcher.push(timeout=30)["method"] != "end":
            pass
        for cl in (c, follower, watcher):
            cl.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- 12: following the lifecycle

def answered(port, method):
    """How many `method` requests astraid answered with code 0 (its /metrics)."""
    return value(parse(http_get(port, "/metrics")[2].decode()), "astrai_requests_total",
                 method=method, code=0) or 0


def check_follow_lifecycle(root, model, data):
    port = tu.free_port()
    d = du.Daemon(os.path.join(root, "follow"), args=[f"--http=127.0.0.1:{port}"])
    os.makedirs(d.root)
    d.start()
    job_file = os.path.join(root, "job.json")
    with open(job_file, "w") as f:
        json.dump(du.spec(model, data, n_epoch=12, name="long"), f)  # 240 steps
    with du.guarded(d):
        c = d.client()
        waiter = ctl_bg(d, "submit", job_file, "--wait")
        jid = int(waiter.stdout.readline().split()[1])  # "job 1 queued"
        watch = ctl_bg(d, "watch", str(jid))
        follow = ctl_bg(d, "logs", str(jid), "-f")
        with du.hold(c, jid) as held:  # paused mid-run, whatever the machine's speed
            # All three follow the job before it is paused (--wait watches it too).
            lu.wait_for("watch --wait, watch and logs -f following the job",
                        lambda: answered(port, "watch") >= 2 and answered(port, "logs") >= 1)
            held.advance(du.progress_db(d, jid), to=3)
            c.call("pause", {"job": jid})
        du.wait_job(c, jid, ["paused"])
        # Pushes they got are read in order: one that stopped at pause would print paused,
        # not completed, below; this only says it sooner.
        for p in (waiter, watch, follow):
            assert p.poll() is None, f"{p.args[2:]} stopped at pause: {p.communicate()}"
        c.call("resume", {"job": jid})
        du.wait_job(c, jid, ["completed"], timeout=180)
        rc, out, err = finish(waiter, 30)
        assert rc == 0 and out.strip() == f"job {jid} completed", (rc, out, err)
        rc, out, err = finish(watch, 30)
        states = [line.split()[3] for line in out.splitlines()]
        assert rc == 0 and "paused" in states and states[-1] == "completed", (rc, out, err)
        rc, followed, err = finish(follow, 30)
        assert rc == 0, (rc, err)
        # On a finished job: the tail, then it returns (the daemon ends the follow at once).
        p = ctl(d, "logs", str(jid), "--tail", "3", "-f", timeout=20)
        tail = ctl(d, "logs", str(jid), "--tail", "3").stdout
        assert p.returncode == 0 and p.stdout == tail and tail.strip(), (p, tail)
        assert followed.endswith(tail), (followed[-500:], tail)
        # The same on the wire: the reply, then the end push.
        for method, params in (("logs", {"job": jid, "follow": True}), ("watch", {"job": jid})):
            c.call(method, params)
            assert c.push(timeout=10) == {"jsonrpc": "2.0", "method": "end",
                                          "params": {"job": jid, "state": "completed"}}
        c.close()
        assert d.stop() == 0


# ---------------------------------------------------------------- 13: one default socket

def check_default_socket(root):
    """astraid and astraictl without --socket meet on the same path, for a user that is not
    root, with and without XDG_RUNTIME_DIR (and for $ASTRAID_SOCKET)."""
    home = os.path.join(root, "user")
    os.makedirs(home)
    for name in ("astraid", "astraictl"):  # where any uid may run them
        shutil.copy(tu.binary(name), home)
    as_root = os.geteuid() == 0
    uid = random.randint(200000, 299999) if as_root else os.geteuid()
    runtime = os.path.join(home, "runtime")
    os.makedirs(runtime)
    for path in (home, runtime):
        os.chmod(path, 0o755)
        if as_root:
            os.chown(path, uid, uid)
    ids = {"user": uid, "group": uid, "extra_groups": []} if as_root else {}
    base = {k: v for k, v in os.environ.items()
            if k not in ("XDG_RUNTIME_DIR", "ASTRAID_SOCKET")}
    cases = [({}, f"/tmp/astraid-{uid}/astraid.sock"),
             ({"XDG_RUNTIME_DIR": runtime}, f"{runtime}/astraid/astraid.sock"),
             ({"ASTRAID_SOCKET": f"{home}/env.sock"}, f"{home}/env.sock")]
    for extra, want in cases:
        env = dict(base, HOME=home, **extra)
        log = open(os.path.join(home, "astraid.log"), "ab")
        daemon = subprocess.Popen(
            [os.path.join(home, "astraid"), f"--state-dir={home}/state", "--devices=cpu:1",
             "--train-binary=/bin/true"], stdout=log, stderr=log, env=env, **ids)
        try:
            deadline, p = time.time() + 30, None
            while time.time() < deadline and daemon.poll() is None:
                p = subprocess.run([os.path.join(home, "astraictl"), "--json", "daemon"],
                                   capture_output=True, text=True, env=env, timeout=30, **ids)
                if p.returncode == 0:
                    break
                time.sleep(0.1)
            assert p and p.returncode == 0, (
                f"{extra}: astraictl did not find astraid: {p and p.stderr}\n"
                f"{open(os.path.join(home, 'astraid.log')).read()[-2000:]}")
            assert json.loads(p.stdout)["sockets"] == [want], (extra, p.stdout)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
            log.close()
    if as_root:
        shutil.rmtree(f"/tmp/astraid-{uid}", ignore_errors=True)


# ---------------------------------------------------------------- 14: the envelope

def check_envelope(d):
    c = StrictClient(d.socket)

    def raw_call(line):
        c.send_raw(line + b"\n")
        return c.reply(), c.raw[-1]

    # An id is echoed as sent, digits that a double would lose included.
    m, raw = raw_call(b'{"jsonrpc":"2.0","id":123456789012345678901234567890,'
                      b'"method":"daemon.info"}')
    assert raw.startswith(b'{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":'), raw
    m, raw = raw_call(b'{"jsonrpc":"2.0","id":1e999,"method":"daemon.info"}')
    assert m["id"] is None and m["error"]["code"] == -32600 and "1e999" in m["error"]["message"], m
    # A NUL in a string would cut it: "daemon.info\u0000xyz" must not run daemon.info.
    m, raw = raw_call(b'{"jsonrpc":"2.0","id":2,"method":"daemon.info\\u0000xyz"}')
    assert "result" not in m and m["error"]["code"] == -32600, m
    m, raw = raw_call(b'{"jsonrpc":"2.0","id":3,"method":"status","params":{"job\\u0000x":1}}')
    assert "result" not in m and m["error"]["code"] == -32600, m
    # Raw control bytes inside a string (JSON forbids them) and between tokens.
    m, raw = raw_call(b'{"jsonrpc":"2.0","id":4,"method":"daemon.info","params":{"a":"x\x01y"}}')
    assert m["id"] is None and m["error"]["code"] == -32700, m
    m, raw = raw_call(b'{"jsonrpc":"2.0",\x0b"id":5,"method":"daemon.info"}')
    assert m["error"]["code"] == -32700, m
    assert "version" in c.call("daemon.info")  # the connection stays usable
    c.close()


def check_pipelining(d):
    """A client that pipelines many requests and reads as it goes gets every reply, in order
    (flow control holds it back, never drops it)."""
    c = d.client()
    n = 20000
    lines = b"".join(b'{"jsonrpc":"2.0","id":%d,"method":"status","params":{"job":1}}\n' % i
                     for i in range(1, n + 1))
    sender = threading.Thread(target=c.sock.sendall, args=(lines,), daemon=True)
    sender.start()
    for i in range(1, n + 1):
        m = c.read_message()
        assert m["id"] == i and m["error"]["code"] == -32001, (i, m)
    sender.join(30)
    c.close()


# ---------------------------------------------------------------- 15: bounded memory

CHATTY_RANK = """#!/usr/bin/python3
import sys, time
line = ("x" * 180 + "\\n").encode()
while True:  # 4000 output lines a second (0.7 MB/s), in bursts
    t = time.time()
    sys.stderr.buffer.write(line * 200)
    sys.stderr.buffer.flush()
    time.sleep(max(0.0, 0.05 - (time.time() - t)))
"""


# Reads every line astraid pushes of a job's log (argv: socket, job) until its stdin closes;
# prints "flowing" at its first lines, then its line count and whether astraid dropped it.
GOOD_FOLLOWER = """#!/usr/bin/python3
import json, select, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "logs", "params": {
    "job": int(sys.argv[2]), "follow": True, "tail": 0}}).encode() + b"\\n")
lines, dropped, said = 0, False, False
while sys.stdin not in select.select([s, sys.stdin], [], [])[0]:
    chunk = s.recv(1 << 16)
    if not chunk:
        dropped = True
        break
    lines += chunk.count(b"\\n")
    if lines > 1 and not said:
        print("flowing", flush=True)
        said = True
print(lines, "dropped" if dropped else "kept", flush=True)
"""


def raised_priority():
    """A child's preexec_fn: ahead of the load (a CPU hog beside the suite), as root."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        pass


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def connect(d):
    """A raw non-blocking connection (the backlog may be full for a moment: retried)."""
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(d.socket)
            s.setblocking(False)
            return s
        except BlockingIOError:
            s.close()
            time.sleep(0.02)
    raise AssertionError("cannot connect to astraid")


# Libraries of training that astraid must not link: it only plans (the parameter table from a
# config, engine/param_table.c) and forks ranks; linked, they cost it ~160 MiB of RSS.
TRAINING_LIBRARIES = ("libopenblas", "libdnnl", "libcudart", "libcublas", "libnccl", "libgomp",
                      "libomp")


def check_linked_libraries():
    out = subprocess.run(["readelf", "-d", tu.binary("astraid")], capture_output=True, text=True,
                         check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    print(f"astraid needs: {' '.join(needed)}")
    linked = [n for n in needed if n.startswith(TRAINING_LIBRARIES)]
    assert needed and not linked, f"astraid links training libraries: {linked}"


def check_memory(root, model, data):
    chatty = write_script(os.path.join(root, "chatty_rank"), CHATTY_RANK)
    d = du.Daemon(os.path.join(root, "memory"), args=[f"--train-binary={chatty}"])
    os.makedirs(d.root)
    d.start()
    with du.guarded(d):
        c = d.client()
        jid = c.call("submit", du.spec(model, data, max_restarts=0))["job"]
        du.wait_job(c, jid, ["running"])
        base = rss(d.proc.pid)
        stop = threading.Event()
        samples, latencies, good_lines = [], [], [0]

        def probe():  # a good client: daemon.info every 0.1 s, and the RSS
            pc = d.client()
            pc.sock.settimeout(5)
            while not stop.is_set():
                t = time.time()
                samples.append(rss(d.proc.pid))
                try:
                    assert "version" in pc.call("daemon.info")
                finally:
                    latencies.append(time.time() - t)
                time.sleep(0.1)
            pc.close()

        errors = []
        threads = [threading.Thread(target=_record, args=(probe, errors), daemon=True)]
        for t in threads:
            t.start()
        # The follower that reads every pushed line, never the one dropped: a process of its
        # own, ahead of the load, so that it keeps reading however busy the machine is.
        good = subprocess.Popen(["/usr/bin/python3", "-c", GOOD_FOLLOWER, d.socket, str(jid)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                preexec_fn=raised_priority)
        flowing = select.select([good.stdout], [], [], 30)[0] and good.stdout.readline()
        assert flowing == "flowing\n", f"no output from the chatty rank: {flowing!r}"
        hostile = []
        for i in range(50):  # followers and watchers that never read
            h = connect(d)
            h.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "logs" if i % 5 else "watch",
                               "params": {"job": jid, "follow": True} if i % 5 else {}})
                   .encode() + b"\n")
            hostile.append(h)
        request = b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n' * 2000
        pipeliners = [connect(d) for _ in range(150)]
        hostile += pipeliners
        deadline = time.time() + 12
        while time.time() < deadline and not errors:
            for s in pipeliners:  # requests without reading a reply
                try:
                    s.send(request)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    pass
            time.sleep(0.05)
            if not SANITIZED and samples and samples[-1] > base + RSS_GROWTH:
                break
        peak = max(samples) if samples else 0
        for s in hostile:
            s.close()
        # The daemon sees them go and gives their memory back: c, the probe's and the good
        # follower's connections are left.
        lu.wait_for("astraid dropping the hostile clients",
                    lambda: c.call("daemon.info")["connections"] <= 3)
        after = rss(d.proc.pid)
        stop.set()
        for t in threads:
            t.join(15)
        lines, kept = good.communicate("", timeout=30)[0].split()
        assert kept == "kept", "the reading follower was dropped"
        good_lines[0] = int(lines)
        worst = max(latencies)
        print(f"astraid RSS: {base >> 20} MiB before, peak {peak >> 20} MiB, {after >> 20} MiB "
              f"after the clients left; daemon.info worst {worst * 1000:.0f} ms over "
              f"{len(latencies)} calls; the reading follower got {good_lines[0]} lines")
        assert worst < LATENCY_BOUND, f"daemon.info took {worst:.2f} s under the flood"
        if not SANITIZED:  # ASan keeps freed memory in quarantine
            assert peak < base + RSS_GROWTH, (f"astraid grew from {base >> 20} to {peak >> 20} MiB "
                                              f"(bound +{RSS_GROWTH >> 20})")
            assert after < base + (32 << 20), f"{after >> 20} MiB kept after the clients left"
        assert not errors, repr(errors[0])
        assert good_lines[0] > 1000, good_lines
        deadline = time.time() + 10
        while c.call("daemon.info")["connections"] > 1:  # only c is left
            assert time.time() < deadline, c.call("daemon.info")
            time.sleep(0.1)
        c.call("cancel", {"job": jid})
        c.close()
        assert d.stop() == 0


def _record(fn, errors):
    try:
        fn()
    except BaseException as e:  # reported by the main thread
        errors.append(e)


# ---------------------------------------------------------------- 16: TCP peers and unix users

def read_until_closed(sock, timeout):
    """The messages a peer gets until astraid closes it (None: still open at timeout)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:  # closed with our bytes unread
        pass
    return [json.loads(line) for line in data.splitlines()]


def check_tcp_limits(root):
    token = "t0ken-" + str(random.random())
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(token)
    os.chmod(token_file, stat.S_IRUSR | stat.S_IWUSR)
    port = tu.free_port()
    d = du.Daemon(os.path.join(root, "tcp"),
                  args=[f"--tcp=127.0.0.1:{port}", f"--token-file={token_file}",
                        "--max-connections=16", "--max-unauthenticated=8", "--auth-timeout=2"])
    os.makedirs(d.root)
    d.start()
    with du.guarded(d):
        t0 = time.time()  # before the first connects: their auth timeout runs from later
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        # Past 8, unauthenticated peers are refused at once ...
        refused = [read_until_closed(s, 5) for s in idle[8:]]
        assert all(r and r[0]["error"]["code"] == -32004 for r in refused), refused[:3]
        # ... and unix users still get in, up to their own limit.
        users = [d.client() for _ in range(15)]
        for u in users:
            assert "version" in u.call("daemon.info")
        # A peer that authenticates in time is served (the pool of 8 is full meanwhile, so
        # this one waits for a slot: the idle ones go after the auth timeout).
        for r in (read_until_closed(s, 10) for s in idle[:8]):
            assert r and r[0]["error"]["code"] == -32003 and "no auth within" in \
                r[0]["error"]["message"], r
        waited = time.time() - t0
        assert 1.5 < waited < 8, f"idle peers closed after {waited:.1f} s (auth-timeout 2)"
        good = du.Client(tcp=("127.0.0.1", port))
        assert good.call("auth", {"token": token}) == {"ok": True}
        assert "version" in good.call("daemon.info")
        # An authenticated peer takes a slot of max-connections: with 15 unix users and it,
        # the next one over either transport is refused.
        more = du.Client(tcp=("127.0.0.1", port))
        du.expect_error(lambda: more.call("auth", {"token": token}), -32004)
        extra = d.client()
        assert extra.read_message()["error"]["code"] == -32004
        # Sending a lot before authenticating is not allowed either.
        flood = socket.create_connection(("127.0.0.1", port))
        flood.sendall(b"x" * (64 << 10))
        assert read_until_closed(flood, 5) is not None, "a pre-auth flood was kept"
        for s in idle + users + [good.sock, more.sock, extra.sock, flood]:
            s.close()
        assert d.stop() == 0


def main():
    root = tu.tmpdir()
    os.chmod(root, 0o755)
    model, data = du.make_setup(root, n_windows=16)
    t = time.time()
    check_default_socket(root)
    print(f"default socket ok ({time.time() - t:.1f} s)")
    t = time.time()
    check_tcp_limits(root)
    print(f"tcp limits ok ({time.time() - t:.1f} s)")
    t = time.time()
    check_utf8(root, model, data)
    print(f"utf-8 ok ({time.time() - t:.1f} s)")
    t = time.time()
    d = du.Daemon(os.path.join(root, "envelope"))
    os.makedirs(d.root)
    d.start()
    with du.guarded(d):
        check_envelope(d)
        check_pipelining(d)
        assert d.stop() == 0
    print(f"envelope ok ({time.time() - t:.1f} s)")
    t = time.time()
    check_linked_libraries()
    check_memory(root, model, data)
    print(f"memory ok ({time.time() - t:.1f} s)")
    t = time.time()
    check_follow_lifecycle(root, *du.make_setup(os.path.join(root, "long"), n_windows=80))
    print(f"follow lifecycle ok ({time.time() - t:.1f} s)")
    print("ok")


if __name__ == "__main__":
    main()
