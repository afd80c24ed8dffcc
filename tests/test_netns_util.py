"""tests/netns_util.py: two hosts talk TCP from one's address to the other's; each has its
own hostname and private /dev/shm (shared by its processes) on the machine's kernel;
link_down makes a connect fail and link_up restores it; nothing is left behind on exit,
on SIGTERM of the test, and (removed by the next run) after a SIGKILL. Skipped (exit 77,
with the reason) where namespaces cannot be made."""

import os
import signal
import subprocess
import sys
import time

import netns_util as nu

PY = "/usr/bin/python3"
PORT = 7077

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
print("listening", flush=True)
while True:
    c, peer = s.accept()
    data = c.recv(100)
    c.sendall(peer[0].encode() + b" " + data)
    c.close()
"""

CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
except OSError as e:
    print("refused", e)
    sys.exit(1)
c.sendall(b"hello")
print(c.recv(100).decode())
"""

CHILD = """
import sys, netns_util as nu
with nu.Hosts(1) as hosts:
    print(" ".join(h.name for h in hosts), flush=True)
    sys.stdin.read()
"""


def out(host, *argv):
    """The stdout of argv run inside host (checked, stripped)."""
    r = host.run(list(argv), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (argv, r)
    return r.stdout.strip()


def connect(client, server):
    """One TCP exchange from client to server's echo: (ok, what the client printed)."""
    r = client.run([PY, "-c", CLIENT, server.addr, str(PORT)], capture_output=True, text=True,
                   timeout=60)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def wait_for(what, cond, timeout=30):
    """Polls cond() until it is true; raises naming what after timeout seconds."""
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def child(sig):
    """A test process with one host, stopped by sig once its host exists; its namespaces."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([PY, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    names = p.stdout.readline().split()
    assert names == [f"astrai-{p.pid}-0"], names
    assert sorted(nu.namespaces(p.pid)) == sorted(names + [f"astrai-{p.pid}-sw"])
    p.send_signal(sig)
    p.wait(60)
    return p.pid


def main():
    try:
        with nu.Hosts(2) as hosts:
            run(hosts)
    except nu.Unavailable as e:
        print(f"skipped: no network namespaces here: {e}")
        return 77
    assert nu.namespaces(os.getpid()) == [], nu.namespaces(os.getpid())

    # SIGTERM: the test's own cleanup runs; SIGKILL: the next Hosts removes what it left.
    pid = child(signal.SIGTERM)
    assert nu.namespaces(pid) == [], nu.namespaces(pid)
    pid = child(signal.SIGKILL)
    left = nu.namespaces(pid)
    assert left, "a SIGKILLed test left nothing behind?"
    with nu.Hosts(1):
        assert nu.namespaces(pid) == [], nu.namespaces(pid)
    print("ok")
    return 0


def run(hosts):
    a, b = hosts
    pid = os.getpid()
    assert (a.name, a.addr, a.index) == (f"astrai-{pid}-0", "10.77.0.1", 0)
    assert (b.name, b.addr, b.index) == (f"astrai-{pid}-1", "10.77.0.2", 1)
    assert hosts.addrs == ["10.77.0.1", "10.77.0.2"]

    # One kernel, several hosts: the same boot_id, each its hostname and /dev/shm.
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    for h in hosts:
        assert out(h, "cat", "/proc/sys/kernel/random/boot_id") == boot
        assert out(h, "hostname") == h.name
        assert out(h, PY, "-c", "import socket; print(socket.gethostname())") == h.name
        assert out(h, "getent", "hosts", hosts[1 - h.index].name).split()[0] == \
            hosts[1 - h.index].addr
    devs = {out(h, "stat", "-c", "%d", "/dev/shm") for h in hosts} | {
        str(os.stat("/dev/shm").st_dev)}
    assert len(devs) == 3, devs
    shm = f"/dev/shm/netns-util-{pid}"
    out(a, "sh", "-c", f"echo mine > {shm}")
    assert out(a, "cat", shm) == "mine", "a host's processes do not share its /dev/shm"
    assert b.run(["test", "-e", shm]).returncode == 1, "the other host sees the file"
    assert not os.path.exists(shm), "the machine sees the host's /dev/shm"

    # TCP from a's address to b's (b's server is told the peer's address); none on the
    # machine's own namespace.
    server = b.popen([PY, "-c", SERVER, b.addr, str(PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        ok, said = connect(a, b)
        assert ok and said == f"{a.addr} hello", said
        assert b.addr not in subprocess.run(["ip", "-br", "addr"], capture_output=True,
                                            text=True).stdout

        # link_down: a's connect fails; link_up: it works again (once the link is up).
        a.link_down()
        ok, said = connect(a, b)
        assert not ok and "refused" in said, said
        a.link_up()
        wait_for("a connect after link_up", lambda: connect(a, b)[0])
    finally:
        server.kill()
        server.wait()
    assert len(a.pids()) == 1 and a.pids() == [a.holder.pid], a.pids()


if __name__ == "__main__":
    sys.exit(main())
