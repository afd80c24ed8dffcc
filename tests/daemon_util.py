"""Helpers for the astraid tests: start a real daemon on a private socket and state
directory, talk NDJSON JSON-RPC to it over its real socket (no astraictl), and make tiny
training jobs (tests/train_util.py models and data) that take seconds."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import test_launch_util as lu
import train_util as tu

WINDOW, BATCH = 32, 4


class RpcError(Exception):
    def __init__(self, code, message, data=None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.data = code, message, data


class Client:
    """One connection; call() returns the result or raises RpcError; pushes (messages
    without an id) are kept in self.pushes."""

    def __init__(self, path=None, tcp=None, timeout=30):
        if tcp:
            self.sock = socket.create_connection(tcp, timeout=timeout)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        self.buf = b""
        self.next_id = 1
        self.pushes = []

    def close(self):
        self.sock.close()

    def send_raw(self, data):
        self.sock.sendall(data)

    def read_line(self):
        """The next line astraid sent, as raw bytes (without its newline)."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("astraid closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def read_message(self):
        return json.loads(self.read_line())

    def reply(self):
        """The next reply (pushes before it are kept)."""
        while True:
            msg = self.read_message()
            if "id" in msg:
                return msg
            self.pushes.append(msg)

    def call(self, method, params=None):
        rid = self.next_id
        self.next_id += 1
        req = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            req["params"] = params
        self.send_raw((json.dumps(req) + "\n").encode())
        msg = self.reply()
        # id null: an error about the connection itself (busy, line too long)
        assert msg.get("id") in (rid, None), f"reply id {msg.get('id')} for request {rid}: {msg}"
        if "error" in msg:
            e = msg["error"]
            raise RpcError(e["code"], e["message"], e.get("data"))
        return msg["result"]

    def push(self, timeout=60):
        """The next push message."""
        if self.pushes:
            return self.pushes.pop(0)
        self.sock.settimeout(timeout)
        msg = self.read_message()
        assert "id" not in msg, f"expected a push, got {msg}"
        return msg


def expect_error(fn, code, *fragments):
    try:
        got = fn()
    except RpcError as e:
        assert e.code == code, f"error {e.code} ({e.message}), expected {code}"
        for f in fragments:
            assert f in e.message, f"error message {e.message!r} does not name {f!r}"
        return e
    raise AssertionError(f"expected error {code}, got result {got}")


class Daemon:
    """astraid in the foreground with its own socket and state directory."""

    def __init__(self, root, args=(), env=None, devices="cpu:1", max_restarts=None,
                 binary=None):
        self.root = root
        self.socket = os.path.join(root, "astraid.sock")
        self.state_dir = os.path.join(root, "state")
        self.args = [binary or tu.binary("astraid"), f"--socket={self.socket}",
                     f"--state-dir={self.state_dir}", f"--devices={devices}",
                     "--poll-interval=0.1", "--stop-timeout=30"] + list(args)
        if max_restarts is not None:
            self.args.append(f"--max-restarts={max_restarts}")
        self.env = dict(os.environ, **(env or {}))
        self.proc = None
        self.log_path = os.path.join(root, "astraid.log")

    def start(self, wait=True, pass_fds=()):
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log, env=self.env,
                                     pass_fds=pass_fds)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"astraid exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                c = Client(self.socket, timeout=5)
                c.call("daemon.info")
                c.close()
                return
            except (OSError, ConnectionError):
                time.sleep(0.05)
        raise AssertionError(f"astraid did not answer within {timeout} s:\n{self.logs()}")

    def client(self):
        return Client(self.socket)

    def logs(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout=90):
        """Signals astraid and waits; returns its exit code."""
        self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout=90):
        """Waits for astraid (signalled already) to exit; returns its exit code."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"astraid did not exit within {timeout} s:\n{self.logs()}")
        self.log.close()
        return rc

    def kill9(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def make_setup(root, n_windows=80):
    """A tiny model and a dataset of n_windows windows (BATCH per step)."""
    model = tu.make_model(os.path.join(root, "m"))
    data, _ = tu.make_text_data(root, n_windows * WINDOW + 1)
    return model, data


def spec(model, data, **extra):
    s = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_interval": 1000,
         "max_lr": 3e-3, "threads": 1, "random_seed": 7}
    s.update(extra)
    return s


def wait_job(client, job, states, timeout=120, pred=None):
    """Polls status until the job's state is in states (and pred(job) holds)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = client.call("status", {"job": job})
        if last["state"] in states and (pred is None or pred(last)):
            return last
        if last["state"] in ("failed", "cancelled", "completed") and last["state"] not in states:
            raise AssertionError(f"job {job} ended {last['state']}, waited for {states}: {last}")
        time.sleep(0.05)
    raise AssertionError(f"job {job} not in {states} within {timeout} s: {last}")


def running(client, job, pred=None, timeout=120):
    """The job's status once it runs with every rank's pid known (and pred(job) holds)."""
    return wait_job(client, job, ["running"], timeout, lambda j: j["ranks"] and all(
        r["pid"] for r in j["ranks"]) and (pred is None or pred(j)))


def hold(client, job, pred=None, timeout=120):
    """The job's ranks held (lu.Held: stopped) once it runs (and pred(job) holds): it cannot
    end meanwhile, however fast the machine. .job is its status just before."""
    st = running(client, job, pred, timeout)
    held = lu.Held([r["pid"] for r in st["ranks"]])
    held.job = st
    return held


def progress_db(d, job):
    """The job's progress.db (its ranks write it in its run directory)."""
    return os.path.join(d.state_dir, "jobs", str(job), "progress.db")


def checkpoint_past(client, d, job, held, past=None):
    """Lets held (the job's ranks, lu.Held) run until they saved a checkpoint other than
    `past`, holds them again, and returns its path once status shows it."""
    def newer():
        path = lu.progress_value(progress_db(d, job),
                                 "SELECT path FROM checkpoints ORDER BY step DESC LIMIT 1")
        return path != past and path
    path = held.advance_until(f"a checkpoint of job {job} past {past}", newer)
    wait_job(client, job, ["running"], pred=lambda j: j["last_checkpoint"] == path)
    return path


def caught_up(client):
    """Returns once astraid has read and dispatched every line that reached any of its
    sockets before this call (a pipelined request, one sent on another connection): each
    loop turn reads every socket that has input, and a request sent once the previous one's
    reply came back is read in a later turn than the lines already waiting."""
    for _ in range(2):
        client.call("daemon.info")


def final_loss(job_status):
    """The loss of the last metric.jsonl row of the job's latest checkpoint."""
    ckpt = tu.latest_checkpoint(job_status["spec"]["ckpt_dir"])
    return tu.metric_rows(ckpt)[-1]


pid_alive = lu.alive


def latest_run(state_dir, job, column):
    """A column of the job's latest row in astraid.db's runs table (None without one)."""
    import sqlite3
    db = sqlite3.connect(os.path.join(state_dir, "astraid.db"), timeout=5)
    row = db.execute(f"SELECT {column} FROM runs WHERE job_id=? ORDER BY run DESC LIMIT 1",
                     (job,)).fetchone()
    db.close()
    return row[0] if row else None


def events(d, job, kind):
    """The detail of each of the job's events of one kind in astraid.db, oldest first."""
    import sqlite3
    db = sqlite3.connect(os.path.join(d.state_dir, "astraid.db"), timeout=5)
    rows = db.execute("SELECT detail FROM events WHERE job_id=? AND kind=? ORDER BY id",
                      (job, kind)).fetchall()
    db.close()
    return [r[0] for r in rows]


def rank_pids(state_dir, job):
    """The rank pids astraid recorded for the job's latest run."""
    pids = latest_run(state_dir, job, "pids")
    return json.loads(pids) if pids else []


def wait_run_ended(state_dir, job):
    """Until astraid has decided on the end of the job's latest run (its outcome is written:
    queued in the loop's turn that decided, so whatever the loop answers from now on comes
    after that decision, the queue looked at again included)."""
    return lu.wait_for(f"the end of job {job}'s run in astraid.db",
                       lambda: latest_run(state_dir, job, "outcome"))


def wait_gone(pids, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def dump_on_failure(daemon):
    return f"\n--- astraid log ---\n{daemon.logs()[-4000:]}"


@contextlib.contextmanager
def started_with_setup(**daemon_options):
    """A fresh root with make_setup's model and data, and a daemon started there, guarded:
    yields (daemon, its client, model, data)."""
    root = tu.tmpdir()
    model, data = make_setup(root)
    d = Daemon(root, **daemon_options).start()
    with guarded(d):
        yield d, d.client(), model, data


@contextlib.contextmanager
def guarded(daemon):
    """The body of a daemon test: on failure, prints the daemon's log and kills it."""
    try:
        yield daemon
    except BaseException:
        print(dump_on_failure(daemon), file=sys.stderr)
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        raise
