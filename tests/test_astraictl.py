"""astraictl against a scripted NDJSON server (no real daemon): the exact request
lines it sends, rendering, --json, exit codes, client-side validation, TCP + token."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

BIN = os.path.join(os.environ["ASTRAI_BUILD"], "astraictl")
TMP = tempfile.mkdtemp(prefix="astraictl-test-")
FAILURES = []
SERVERS = iter(range(1000))


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what, file=sys.stderr)


def req(id_, method, params):
    return json.dumps({"jsonrpc": "2.0", "id": id_, "method": method, "params": params},
                      separators=(",", ":"))


def reply(id_, result):
    return json.dumps({"jsonrpc": "2.0", "id": id_, "result": result})


def error(id_, code, message):
    return json.dumps({"jsonrpc": "2.0", "id": id_, "error": {"code": code, "message": message}})


def push(method, params):
    return json.dumps({"jsonrpc": "2.0", "method": method, "params": params})


def job(id_, name, state, step=120, total=400, loss=3.41723, rate=51234.5, eta=312.4, error=None):
    return {"id": id_, "name": name, "state": state, "spec": {"train_type": "seq"}, "step": step,
            "total_steps": total, "epoch": 0, "loss": loss, "lr": 2.8e-4, "grad_norm": 0.9,
            "tokens_per_s": rate, "eta_s": eta, "restarts": 0, "devices": ["cpu:0"],
            "last_checkpoint": None, "error": error, "submitted_by": 1000,
            "created_at": "2025-01-05T10:00:00Z", "started_at": None, "finished_at": None}


class FakeServer:
    """Serves one connection: for each request line received, takes the next step of
    the script (the replies to send, the server checks nothing itself) and records the
    line. Tests compare the recorded lines with the exact lines expected."""

    def __init__(self, script, tcp=False, hold=True):
        self.script = list(script)
        self.hold = hold  # keep the connection open after the script, until the client closes
        self.lines = []
        self.connections = 0
        if tcp:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.bind(("127.0.0.1", 0))
            self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        else:
            self.address = os.path.join(TMP, "s%d.sock" % next(SERVERS))
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(self.address)
        self.sock.listen(8)
        self.sock.settimeout(20)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.connections += 1
        conn.settimeout(20)
        buf = b""
        try:
            while self.script:
                while b"\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                line, buf = buf.split(b"\n", 1)
                self.lines.append(line.decode())
                for out in self.script.pop(0):  # str, or bytes that need not be UTF-8
                    conn.sendall((out if isinstance(out, bytes) else out.encode()) + b"\n")
            if self.hold:
                conn.recv(1)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a pending accept
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


def run(args, server=None, env=None, expect_rc=None, what="", text=True):
    cmd = [BIN] + (["--socket", server.address] if server and "--host" not in args else []) + args
    p = subprocess.run(cmd, capture_output=True, text=text, timeout=60,
                       env=dict(os.environ, **(env or {})))
    if expect_rc is not None:
        check(p.returncode == expect_rc, "%s: rc %d, expected %d; stderr: %s stdout: %s" % (
            what or args, p.returncode, expect_rc, p.stderr, p.stdout))
    return p


def write_job(name, spec):
    path = os.path.join(TMP, name)
    with open(path, "w") as f:
        json.dump(spec, f) if not isinstance(spec, str) else f.write(spec)
    return path


def test_usage():
    for args in ([], ["frobnicate"], ["pause"], ["pause", "abc"], ["pause", "0"],
                 ["list", "--wait"], ["status", "--rank", "1"], ["--timeout", "0", "list"],
                 ["logs", "3", "--tail", "-2"], ["submit", "a.json", "--wait", "--follow"],
                 ["--bogus", "list"], ["status", "1", "2"], ["--host", "h:1", "list"]):
        p = run(args, expect_rc=2)
        check("astraictl" in p.stderr, "usage error message for %s: %r" % (args, p.stderr))
    p = run(["--help"], expect_rc=0)
    check("submit FILE.json" in p.stdout and "exit codes" in p.stdout, "--help text")


def test_bad_job_files_never_connect():
    good = {"train_type": "seq", "param_path": "/m", "data_root_path": "/d"}
    cases = [
        (dict(good, max_lrr=1e-3), "unknown key 'max_lrr' (did you mean 'max_lr'?)"),
        ({"param_path": "/m", "data_root_path": "/d"}, "train_type: required"),
        (dict(good, n_epoch="2"), "n_epoch: expected an integer"),
        (dict(good, batch_per_device=0), "batch_per_device: value 0 is out of range"),
        (dict(good, optimizer="sgd"), "optimizer: 'sgd' is not one of"),
        (dict(good, priority=1.5), "priority: expected an integer"),
        (dict(good, nprocs=2, devices=3, parallel_mode="ddp"), "devices: 3 device(s) but nprocs is 2"),
        ('{"train_type": "seq",', "not valid JSON"),
    ]
    server = FakeServer([])
    for i, (spec, message) in enumerate(cases):
        path = write_job("bad%d.json" % i, spec)
        p = run(["submit", path, "--wait"], server, expect_rc=2)
        check(message in p.stderr and path in p.stderr, "message %r in %r" % (message, p.stderr))
    p = run(["submit", os.path.join(TMP, "missing.json")], server, expect_rc=2)
    check("missing.json" in p.stderr, "missing file named: " + p.stderr)
    server.close()
    check(server.connections == 0, "a bad job file must never reach the daemon")


def test_list_table_and_json():
    jobs = [job(1, "tiny", "running"), job(12345, "a-very-long-job-name-indeed", "queued", step=0,
                                            total=0, loss=None, rate=None, eta=None)]
    server = FakeServer([[reply(1, {"jobs": jobs})]])
    p = run(["list"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "list", {})], "list request: %s" % server.lines)
    rows = p.stdout.splitlines()
    check(len(rows) == 3 and all(len(r) <= 80 for r in rows), "table fits 80 columns: %r" % rows)
    check(rows[0].split() == ["ID", "NAME", "STATE", "STEP", "LOSS", "TOK/S", "ETA"], rows[0])
    check(rows[1].split() == ["1", "tiny", "running", "120/400", "3.4172", "51.2k", "5m12s"], rows[1])
    check(rows[2].split() == ["12345", "a-very-long-job-", "queued", "0", "-", "-", "-"], rows[2])

    server = FakeServer([[reply(1, {"jobs": jobs})]])
    p = run(["list", "--state", "running", "--json"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "list", {"state": "running"})], "list --state: %s" % server.lines)
    check(json.loads(p.stdout) == {"jobs": jobs}, "list --json is the raw result")


def test_status():
    server = FakeServer([[reply(1, job(3, "tiny", "running"))]])
    p = run(["status", "3", "--json"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "status", {"job": 3})], "status request: %s" % server.lines)
    check(json.loads(p.stdout) == job(3, "tiny", "running"), "status --json")

    server = FakeServer([[reply(1, job(3, "tiny", "running"))]])
    p = run(["status", "3"], server, expect_rc=0)
    server.close()
    check("job 3 (tiny): running, step 120/400, loss 3.4172" in p.stdout, p.stdout)
    check("\nlast_checkpoint  null\n" in p.stdout, p.stdout)
    check("expert_load" not in p.stdout.splitlines()[0], "a dense job's line: " + p.stdout)

    # A mixture of experts' load extremes after the loss (and the loss scale), over the mean.
    moe = dict(job(4, "moe", "running"), loss_scale=65536, skipped_steps=2,
               expert_load_max=1.4237, expert_load_min=0.6149)
    server = FakeServer([[reply(1, moe)]])
    p = run(["status", "4"], server, expect_rc=0)
    server.close()
    check(p.stdout.splitlines()[0] == "job 4 (moe): running, step 120/400, loss 3.4172, "
          "loss_scale 65536 (2 skipped) expert_load max 1.42x min 0.61x of mean, 51.2k tok/s, "
          "ETA 5m12s", p.stdout)

    # status without a job is list
    server = FakeServer([[reply(1, {"jobs": []})]])
    p = run(["status"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "list", {})] and p.stdout.startswith("ID"), "status = list")


def test_daemon_error_is_exit_1():
    server = FakeServer([[error(1, -32001, "no such job: 42")]])
    p = run(["status", "42"], server, expect_rc=1)
    server.close()
    check("no such job: 42" in p.stderr, p.stderr)
    server = FakeServer([[error(1, -32002, "job 2 is completed: cannot pause")]])
    p = run(["pause", "2"], server, expect_rc=1)
    server.close()
    check(server.lines == [req(1, "pause", {"job": 2})], server.lines)
    check("job 2 is completed: cannot pause" in p.stderr, p.stderr)


def test_verbs():
    for verb, state in (("pause", "pausing"), ("resume", "queued"), ("checkpoint", "running"),
                        ("cancel", "cancelled")):
        server = FakeServer([[reply(1, job(7, "x", state))]])
        p = run([verb, "7"], server, expect_rc=0)
        server.close()
        check(server.lines == [req(1, verb, {"job": 7})], "%s request %s" % (verb, server.lines))
        check(p.stdout == "job 7: %s\n" % state, "%s output %r" % (verb, p.stdout))


def test_daemon_info():
    info = {"version": "0.1.0", "pid": 42, "uptime_s": 3.5, "state_dir": "/var/lib/astraid",
            "jobs": {"running": 1}}
    server = FakeServer([[reply(1, info)]])
    p = run(["daemon", "--json"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "daemon.info", {})] and json.loads(p.stdout) == info, p.stdout)
    server = FakeServer([[reply(1, info)]])
    p = run(["daemon"], server, expect_rc=0)
    server.close()
    check("state_dir  /var/lib/astraid" in p.stdout and '{"running":1}' in p.stdout, p.stdout)


def test_cannot_connect():
    p = run(["--socket", os.path.join(TMP, "nobody.sock"), "list"], expect_rc=3)
    check("cannot connect" in p.stderr and "nobody.sock" in p.stderr, p.stderr)
    # a socket file nobody listens on: connection refused
    path = os.path.join(TMP, "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    p = run(["--socket", path, "status", "1"], expect_rc=3)
    s.close()
    check("Connection refused" in p.stderr, p.stderr)
    # $ASTRAID_SOCKET is used without --socket
    p = run(["list"], env={"ASTRAID_SOCKET": os.path.join(TMP, "env.sock")}, expect_rc=3)
    check("env.sock" in p.stderr, p.stderr)
    # a daemon that never answers: --timeout
    server = FakeServer([[]])
    p = run(["--timeout", "0.3", "list"], server, expect_rc=3)
    server.close()
    check("no reply from astraid within 0.3 s" in p.stderr, p.stderr)


def test_tcp_token():
    token_file = os.path.join(TMP, "token")
    with open(token_file, "w") as f:
        f.write("s3cret-token\n")
    os.chmod(token_file, 0o600)
    server = FakeServer([[reply(1, {"ok": True})], [reply(2, {"jobs": []})]], tcp=True)
    run(["--host", server.address, "--token-file", token_file, "list"], expect_rc=0)
    server.close()
    check(server.lines == [req(1, "auth", {"token": "s3cret-token"}), req(2, "list", {})],
          "tcp lines: %s" % server.lines)
    server = FakeServer([[error(1, -32003, "unauthorized: bad token")]], tcp=True)
    p = run(["--host", server.address, "--token-file", token_file, "list"], expect_rc=1)
    server.close()
    check("unauthorized" in p.stderr and len(server.lines) == 1, p.stderr)
    p = run(["--host", server.address, "--token-file", os.path.join(TMP, "none"), "list"],
            expect_rc=2)


def good_job_file():
    return write_job("good.json", {"name": "tiny", "train_type": "seq", "param_path": "model",
                                   "data_root_path": "/data/d", "max_steps": 4})


def test_submit():
    path = good_job_file()
    server = FakeServer([[reply(1, {"job": 5, "state": "queued"})]])
    p = run(["submit", path], server, expect_rc=0)
    server.close()
    sent = json.loads(server.lines[0])
    check(sent["method"] == "submit" and sent["id"] == 1, server.lines)
    check(sent["params"]["param_path"] == os.path.join(os.getcwd(), "model"),
          "relative paths made absolute: %s" % sent["params"])
    check(sent["params"]["data_root_path"] == "/data/d" and sent["params"]["max_steps"] == 4, sent)
    check(p.stdout == "job 5 queued\n", p.stdout)


def submit_and_wait(final_state, args, error_text=None):
    path = good_job_file()
    end = job(5, "tiny", final_state, step=4, total=4, error=error_text)
    server = FakeServer([
        [reply(1, {"job": 5, "state": "queued"})],
        [reply(2, {"jobs": [job(5, "tiny", "queued", step=0)]}),
         push("progress", job(6, "other", "running")),  # another job: ignored
         push("progress", job(5, "tiny", "running", step=2, total=4)),
         push("progress", end), push("end", {"job": 5, "state": final_state})]])
    p = run(["submit", path] + args, server)
    server.close()
    check(server.lines[1:] == [req(2, "watch", {"job": 5})], "watch request: %s" % server.lines)
    return p


def test_submit_wait_and_follow():
    p = submit_and_wait("completed", ["--wait"])
    check(p.returncode == 0 and p.stdout == "job 5 queued\njob 5 completed\n", (p.returncode, p.stdout))
    p = submit_and_wait("failed", ["--wait"], "rank 0 exited with code 1: boom")
    check(p.returncode == 4 and "job 5 failed: rank 0 exited with code 1: boom" in p.stderr,
          (p.returncode, p.stderr))
    p = submit_and_wait("cancelled", ["--wait"])
    check(p.returncode == 4, "cancelled → 4")
    p = submit_and_wait("completed", ["--follow"])
    lines = p.stdout.splitlines()
    check(p.returncode == 0 and "job 5 tiny running step 2/4 loss 3.4172 tok/s 51.2k ETA 5m12s" in lines
          and not any("other" in l for l in lines), p.stdout)


def test_watch_plain():
    server = FakeServer([[reply(1, {"jobs": [job(1, "a", "running"), job(2, "b", "queued", step=0)]}),
                          push("progress", job(2, "b", "running", step=7, total=10, eta=3725))]],
                        hold=False)
    # watch of every job runs until the daemon goes away (the server closes after its script)
    # and, with --reconnect-timeout 0, does not wait for it to come back
    p = run(["watch", "--reconnect-timeout", "0"], server)
    server.close()
    check(server.lines == [req(1, "watch", {})], server.lines)
    check(p.returncode == 3 and "connection to astraid closed" in p.stderr, (p.returncode, p.stderr))
    check(p.stdout.splitlines() == [
        "job 1 a running step 120/400 loss 3.4172 tok/s 51.2k ETA 5m12s",
        "job 2 b queued step 0/400 loss 3.4172 tok/s 51.2k ETA 5m12s",
        "job 2 b running step 7/10 loss 3.4172 tok/s 51.2k ETA 1h02m"], p.stdout)
    server = FakeServer([[reply(1, {"jobs": [job(2, "b", "running")]}),
                          push("progress", job(2, "b", "completed", step=400))]])
    p = run(["watch", "2", "--json"], server, expect_rc=0)
    server.close()
    check([json.loads(l)["state"] for l in p.stdout.splitlines()] == ["running", "completed"], p.stdout)


def test_logs():
    server = FakeServer([[reply(1, {"lines": ["a", "b"]}),
                          push("log", {"job": 3, "rank": 1, "line": "c"}),
                          push("log", {"job": 4, "rank": 1, "line": "other job"}),
                          push("end", {"job": 3, "state": "completed"})]])
    p = run(["logs", "3", "--rank", "1", "--tail", "2", "-f"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "logs", {"job": 3, "rank": 1, "tail": 2, "follow": True})],
          server.lines)
    check(p.stdout == "a\nb\nc\n", p.stdout)
    server = FakeServer([[reply(1, {"lines": ["x"]})]])
    p = run(["logs", "3", "--json"], server, expect_rc=0)
    server.close()
    check(server.lines == [req(1, "logs", {"job": 3})] and json.loads(p.stdout) == {"lines": ["x"]},
          p.stdout)


# A name and a ckpt_dir that would clear the screen (ESC [2J, CSI as the C1 control U+009B)
# and break a line (NEL, U+0085) if printed as sent.
EVIL_NAME = "evil\x1b[2J\u0085\u009b6n\x7fjob"
EVIL_DIR = "/tmp/ck\x1b[2J\u009b\u0085\x07dir"
SHOWN_NAME = "evil\\x1b[2J\\u0085\\u009b6n\\x7fjob"


def evil_job(state="running"):
    j = job(3, EVIL_NAME, state, error="bad\x1b]0;title\x07 \u009b\u0085cause")
    j["spec"]["ckpt_dir"] = EVIL_DIR
    return j


def terminal_unsafe(out):
    """The bytes of out a terminal would act on: C0 controls but newline and tab, DEL, C1
    controls (UTF-8 C2 80..9F), and anything that is not UTF-8."""
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError as e:
        return "not UTF-8: %s" % e
    return [c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


def test_daemon_text_is_shown_safely():
    cases = [
        (["list"], [reply(1, {"jobs": [evil_job()]})], 0),
        (["status", "3"], [reply(1, evil_job())], 0),
        (["watch", "3"], [reply(1, {"jobs": [evil_job()]}), push("progress", evil_job("failed"))], 0),
        (["logs", "3"], [reply(1, {"lines": ["ok", "x\x1b[2J\u009by\u0085z"]})], 0),
        (["pause", "3"], [error(1, -32002, "job %s: \x1b[31mno\u009b" % EVIL_NAME)], 1),
        # raw bytes: C1 controls not escaped in the JSON, a byte that is no UTF-8
        (["list"], [b'{"jsonrpc":"2.0","id":1,"result":{"jobs":[{"id":4,"name":"r\xc2\x9b'
                    b'\xc2\x85\xff\xed\xa0\x80s","state":"queued"}]}}'], 0),
        (["status", "3"], [b"not json \x1b[2J\xc2\x9b"], 3),
    ]
    for args, script, rc in cases:
        server = FakeServer([script])
        p = run(args, server, expect_rc=rc, text=False)
        server.close()
        for stream, out in (("stdout", p.stdout), ("stderr", p.stderr)):
            check(not terminal_unsafe(out), "%s %s unsafe for a terminal: %r %r" % (
                args, stream, terminal_unsafe(out), out))
    server = FakeServer([[reply(1, evil_job())]])
    p = run(["status", "3"], server, expect_rc=0)
    server.close()
    check(p.stdout.startswith("job 3 (%s): running" % SHOWN_NAME), p.stdout)
    check("error            bad\\x1b]0;title\\x07 \\u009b\\u0085cause\n" in p.stdout, p.stdout)
    # --json: the strings exactly as the daemon sent them
    for args, script in ((["list", "--json"], [reply(1, {"jobs": [evil_job()]})]),
                         (["status", "3", "--json"], [reply(1, evil_job())]),
                         (["watch", "3", "--json"], [reply(1, {"jobs": [evil_job("failed")]})])):
        server = FakeServer([script])
        p = run(args, server, expect_rc=0)
        server.close()
        got = json.loads(p.stdout.split("\n")[0])  # not splitlines: U+0085 is a line break
        got = got["jobs"][0] if "jobs" in got else got
        check(got == evil_job(got["state"]), "%s: %r" % (args, p.stdout))


def main():
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
    if FAILURES:
        print("%d failure(s)" % len(FAILURES), file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
