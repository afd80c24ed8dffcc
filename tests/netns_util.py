"""Test "hosts" on one machine: each a network namespace (its own address on a private
bridge), with its own mount namespace (a private tmpfs /dev/shm) and UTS namespace (its own
hostname), so that programs that look at the host (shared memory, hostname, addresses) see
several. Needs root, iproute2 (ip) and util-linux (unshare, nsenter).

    with Hosts(2) as hosts:          # raises Unavailable(reason) where namespaces cannot be made
        h = hosts[0]                 # h.name "astrai-<pid>-0", h.addr "10.77.0.1", h.index 0
        p = h.popen(argv, **kw)      # subprocess.Popen inside h (kw as Popen's)
        h.argv(argv)                 # argv wrapped (nsenter) to run inside h, for other spawners
        r = h.run(argv, **kw)        # subprocess.run inside h
        h.link_down(); h.link_up()   # cuts / restores h's link to every other host
        hosts.addrs                  # ["10.77.0.1", "10.77.0.2"]

A "switch" namespace holds a Linux bridge; each host has one veth pair to it, its end eth0
with 10.77.0.(k+1)/24, and lo up; the machine's own namespace gets no address or route. One
holder process per host keeps its mount and UTS namespaces; popen/run enter it with nsenter.
Each host's /etc/hosts (bind-mounted) names every host. Names carry the test process's pid:
everything is removed on exit (also on an exception or SIGTERM), and what a dead earlier
run left behind is removed at start.
"""

import atexit
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile

PREFIX = "astrai-"
NETNS_DIR = "/run/netns"
SUBNET = "10.77.0"
TOOLS = ("ip", "unshare", "nsenter", "mount", "hostname")


class Unavailable(Exception):
    """Namespaces cannot be made here (not root, a tool missing, EPERM)."""


def _tool(name):
    """The path of a tool, or None."""
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")


def _ip(*args):
    """Runs `ip args`; raises Unavailable with its message when it fails."""
    out = subprocess.run([_tool("ip"), *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise Unavailable(f"ip {' '.join(args)}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def _pid_alive(pid):
    """Whether a process of that pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def ns_pids(ns):
    """The pids of the processes inside the named network namespace."""
    try:
        st = os.stat(os.path.join(NETNS_DIR, ns))
    except OSError:
        return []
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                s = os.stat(f"/proc/{p}/ns/net")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                pids.append(int(p))
    return pids


def _kill_ns(ns):
    """SIGKILLs every process inside the namespace, then deletes it (waits for neither)."""
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    subprocess.run([_tool("ip"), "netns", "del", ns], capture_output=True, timeout=30)


def namespaces(pid=None):
    """The names of the network namespaces this module made (of test process pid, or all)."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    pat = re.compile(re.escape(PREFIX) + r"(\d+)-(sw|\d+)$")
    return [n for n in names if (m := pat.match(n)) and (pid is None or int(m.group(1)) == pid)]


def remove_stale():
    """Removes the namespaces of earlier test processes that are gone."""
    for ns in namespaces():
        pid = int(ns[len(PREFIX):].split("-")[0])
        if pid != os.getpid() and not _pid_alive(pid):
            _kill_ns(ns)


class Host:
    """One test host: h.name (its namespace and hostname), h.addr, h.index."""

    def __init__(self, hosts, index):
        self.index = index
        self.name = f"{hosts.prefix}{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.holder = None

    def argv(self, argv):
        """argv wrapped to run inside this host (its network, mount and UTS namespaces)."""
        return [_tool("nsenter"), f"--target={self.holder.pid}", "--net", "--mount", "--uts",
                "--", *argv]

    def popen(self, argv, **kw):
        """subprocess.Popen(argv, **kw) inside this host."""
        return subprocess.Popen(self.argv(list(argv)), **kw)

    def run(self, argv, **kw):
        """subprocess.run(argv, **kw) inside this host."""
        return subprocess.run(self.argv(list(argv)), **kw)

    def link_down(self):
        """Cuts this host's link to every other host (its eth0 down)."""
        _ip("-n", self.name, "link", "set", "eth0", "down")

    def link_up(self):
        """Restores this host's link (its eth0 up)."""
        _ip("-n", self.name, "link", "set", "eth0", "up")

    def pids(self):
        """The pids of the processes inside this host (its holder included)."""
        return ns_pids(self.name)


class Hosts:
    """n hosts on one bridge; a context manager (made on enter, removed on exit)."""

    def __init__(self, n):
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.switch = f"{self.prefix}sw"
        self.hosts = [Host(self, k) for k in range(n)]
        self.tmp = None
        self._old_term = None

    def __len__(self):
        return len(self.hosts)

    def __getitem__(self, k):
        return self.hosts[k]

    def __iter__(self):
        return iter(self.hosts)

    @property
    def addrs(self):
        """The hosts' addresses, in order."""
        return [h.addr for h in self.hosts]

    def __enter__(self):
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        missing = [t for t in TOOLS if not _tool(t)]
        if missing:
            raise Unavailable(f"not installed: {', '.join(missing)} (iproute2, util-linux)")
        remove_stale()
        atexit.register(self.close)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _sigterm)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        """The switch, the hosts' namespaces, links and holders."""
        self.tmp = tempfile.mkdtemp(prefix=self.prefix)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        etc_hosts = os.path.join(self.tmp, "hosts")
        with open("/etc/hosts") as src, open(etc_hosts, "w") as f:
            f.write(src.read() + "".join(f"\n{h.addr} {h.name}" for h in self.hosts) + "\n")
        for h in self.hosts:
            _ip("netns", "add", h.name)
            port = f"p{h.index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", h.name)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.name, "link", "set", "eth0", "up")
            _ip("-n", h.name, "link", "set", "lo", "up")
            self._hold(h, etc_hosts)

    def _hold(self, h, etc_hosts):
        """Starts h's holder (its private /dev/shm, /etc/hosts and hostname, the machine's
        cgroup mounts) and waits for it."""
        script = (_cgroup_mounts() + "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                  "mount --bind \"$1\" /etc/hosts && hostname \"$2\" && echo ready && "
                  "exec sleep infinity")
        h.holder = subprocess.Popen(
            [_tool("ip"), "netns", "exec", h.name, _tool("unshare"), "--mount", "--uts",
             "--propagation", "private", "sh", "-c", script, "holder", etc_hosts, h.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        line = h.holder.stdout.readline()
        h.holder.stdout.close()
        if line.strip() != b"ready":
            h.holder.wait(30)
            err = h.holder.stderr.read().decode(errors="replace").strip()
            h.holder.stderr.close()
            raise Unavailable(f"the holder of {h.name} exited with {h.holder.returncode}: {err}")
        h.holder.stderr.close()

    def close(self):
        """Kills every process inside the hosts and removes the namespaces (idempotent)."""
        for h in self.hosts:
            _kill_ns(h.name)
            if h.holder is not None:
                h.holder.wait()
                h.holder = None
        subprocess.run([_tool("ip"), "netns", "del", self.switch], capture_output=True,
                       timeout=30)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        atexit.unregister(self.close)


def _cgroup_mounts():
    """Shell commands that mount again what the machine has on /sys/fs/cgroup (ip netns exec
    mounts a fresh /sys without it; slurmd needs it), each best effort."""
    cmds = ""
    with open("/proc/self/mounts") as f:
        for line in f:
            src, mp, fstype, opts = line.split()[:4]
            if mp == "/sys/fs/cgroup" or mp.startswith("/sys/fs/cgroup/"):
                q = [shlex.quote(x) for x in (mp, fstype, opts, src)]
                cmds += f"{{ mkdir -p {q[0]} && mount -t {q[1]} -o {q[2]} {q[3]} {q[0]}; }} 2>/dev/null; "
    return cmds


def _sigterm(signum, frame):
    """SIGTERM of the test: exits through the with statements (their cleanups run)."""
    raise SystemExit(128 + signum)
