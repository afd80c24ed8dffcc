"""astraid under systemd: the sd_notify messages (READY/STATUS at start, STOPPING and
EXTEND_TIMEOUT_USEC while ranks checkpoint on stop) received on a test NOTIFY_SOCKET, a path
and an abstract one; socket activation (a listening unix socket passed as fd 3 with
LISTEN_FDS/LISTEN_PID); a JSON config file whose keys are the flags; and systemd-analyze verify
of the units (warnings count as failures) when systemd-analyze exists."""

import os
import shutil
import signal
import socket
import subprocess
import time

import daemon_util as du
import train_util as tu

SRC = os.environ.get("ASTRAI_SRC", os.path.join(os.path.dirname(__file__), ".."))


def notify_socket(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(60)
    return s


def messages_until(s, key):
    got = []
    while not any(m.startswith(key) for m in got):
        got += s.recv(4096).decode().split("\n")
    return got


def check_notify(root, model, data, abstract):
    name = f"\0astrai-test-{os.getpid()}" if abstract else os.path.join(root, "notify")
    s = notify_socket(name)
    env_name = "@" + name[1:] if abstract else name
    d = du.Daemon(os.path.join(root, "abstract" if abstract else "path"),
                  env={"NOTIFY_SOCKET": env_name})
    os.makedirs(d.root, exist_ok=True)
    d.start(wait=False)
    try:
        with du.guarded(d):
            ready = messages_until(s, "READY=1")
            assert any(m.startswith("STATUS=") for m in ready), ready
            d.wait_ready()
            c = d.client()
            jid = c.call("submit", du.spec(model, data, n_epoch=400))["job"]
            du.wait_job(c, jid, ["running"], pred=lambda j: j["step"] >= 3)
            c.close()
            d.proc.send_signal(signal.SIGTERM)
            stopping = messages_until(s, "STOPPING=1")
            extend = [m for m in stopping if m.startswith("EXTEND_TIMEOUT_USEC=")]
            assert extend and int(extend[0].split("=")[1]) >= 30e6, stopping  # >= --stop-timeout
            assert d.proc.wait(60) == 0, d.logs()
            assert "NOTIFY_SOCKET" not in open(os.path.join(
                d.state_dir, "jobs", str(jid), "run1-rank0.log")).read()
    finally:
        s.close()


def check_socket_activation(root):
    path = os.path.join(root, "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    d = du.Daemon(os.path.join(root, "activation"))
    os.makedirs(d.root, exist_ok=True)
    fd = listener.fileno()
    # LISTEN_PID must be astraid's own pid: a shell sets it and execs astraid.
    cmd = ["/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=astraid.socket exec "$@"',
           "sh"] + d.args
    log = open(d.log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, pass_fds=(3,),
                            preexec_fn=lambda: os.dup2(fd, 3))
    try:
        deadline = time.time() + 30
        while True:
            try:
                c = du.Client(path)
                info = c.call("daemon.info")
                break
            except (OSError, ConnectionError):
                assert time.time() < deadline and proc.poll() is None, d.logs()
                time.sleep(0.05)
        assert info["pid"] == proc.pid, info
        assert not os.path.exists(d.socket), "astraid bound its own socket despite activation"
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, d.logs()
        assert "using the socket passed by systemd" in d.logs(), d.logs()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        listener.close()


def check_config_file(root):
    base = os.path.join(root, "config")
    os.makedirs(base, exist_ok=True)
    sock = os.path.join(base, "from-config.sock")
    config = os.path.join(base, "astraid.json")
    with open(config, "w") as f:
        f.write('{"socket": "%s", "state_dir": "%s", "devices": "cpu:3", "max-restarts": 5}'
                % (sock, os.path.join(base, "state")))
    proc = subprocess.Popen([tu.binary("astraid"), f"--config={config}", "--devices=cpu:2"],
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock):
            assert time.time() < deadline and proc.poll() is None, "astraid did not start"
            time.sleep(0.05)
        c = du.Client(sock)
        for _ in range(100):
            try:
                info = c.call("daemon.info")
                break
            except ConnectionError:
                time.sleep(0.05)
        assert [x["id"] for x in info["devices"]] == ["cpu:0", "cpu:1"], info  # the flag wins
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(config, "w") as f:
        f.write('{"sockett": "/x"}')
    bad = subprocess.run([tu.binary("astraid"), f"--config={config}"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "sockett" in bad.stderr, bad.stderr
    # A key cJSON would cut at a NUL ("socket\u0000x" read as "socket"), a raw control
    # character: refused with the byte offset, not applied.
    for text, want in (('{"socket\\u0000x": "/x"}', "\\u0000 at byte 8"),
                       ('{"socket": "/x\x01"}', "raw control character 0x01")):
        with open(config, "w") as f:
            f.write(text)
        bad = subprocess.run([tu.binary("astraid"), f"--config={config}"], capture_output=True,
                             text=True, timeout=30)
        assert bad.returncode == 2 and want in bad.stderr and config in bad.stderr, bad.stderr


def check_units(root):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        print("systemd-analyze not found: unit verification skipped")
        return
    units = os.path.join(root, "units")
    os.makedirs(units)
    with open(os.path.join(SRC, "systemd", "astraid.service")) as f:
        service = f.read().replace("/usr/local/bin/astraid", tu.binary("astraid"))
    with open(os.path.join(units, "astraid.service"), "w") as f:
        f.write(service)
    shutil.copy(os.path.join(SRC, "systemd", "astraid.socket"), units)
    proc = subprocess.run([analyze, "verify", "--man=no",
                           os.path.join(units, "astraid.service"),
                           os.path.join(units, "astraid.socket")],
                          capture_output=True, text=True, timeout=120)
    ours = [line for line in proc.stderr.splitlines() if "astraid" in line]
    assert proc.returncode == 0 and not ours, f"systemd-analyze verify: {proc.stderr}"
    for key in ("Type=notify", "KillMode=mixed", "TimeoutStopSec=", "RuntimeDirectory=astraid",
                "StateDirectory=astraid", "User=astraid"):
        assert key in service, f"astraid.service lacks {key}"


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root, n_windows=16)
    check_notify(root, model, data, abstract=False)
    check_notify(root, model, data, abstract=True)
    check_socket_activation(root)
    check_config_file(root)
    check_units(root)
    print("ok")


if __name__ == "__main__":
    main()
