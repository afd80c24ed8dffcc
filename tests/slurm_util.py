"""A real Slurm cluster for the tests: munged, slurmctld and slurmd (Debian's munge and
slurm-wlm) on private ports, directories and a private munge socket, started and stopped by
the test. Slurm's client commands find it through SLURM_CONF (Cluster.env).

    with Cluster(root) as c:       # raises Unavailable (with the reason) when it cannot start
        subprocess.run(["sbatch", ...], env=c.env)

With hosts (tests/netns_util.py Hosts), one node per host: each host's slurmd (NodeName and
NodeHostname the host's name, NodeAddr its address), slurmctld on hosts[0], munged on the
machine (its socket is a file every host sees). Slurm's commands then reach slurmctld from
hosts[0] only: c.run runs them there, c.argv(argv) wraps another command to run there.
"""

import os
import shutil
import signal
import socket
import subprocess
import time

import train_util as tu

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


class Unavailable(Exception):
    """Slurm cannot run here (not installed, not root, a daemon would not start)."""


def find(name):
    for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


class Cluster:
    def __init__(self, root, cpus=None, partition="debug", hosts=None):
        self.root = os.path.join(root, "slurm")
        self.cpus = cpus or os.cpu_count()
        self.partition = partition
        self.procs = []
        self.conf = os.path.join(self.root, "slurm.conf")
        self.hosts = hosts
        self.nodes = [h.name for h in hosts] if hosts else ["astrai-node"]
        self.node = self.nodes[0]
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def argv(self, argv):
        """argv wrapped to run where Slurm's commands reach slurmctld (hosts[0], or here)."""
        return self.hosts[0].argv(list(argv)) if self.hosts else list(argv)

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _path(self, *parts):
        return os.path.join(self.root, *parts)

    def _write_conf(self, ctld_port, slurmd_port):
        host = socket.gethostname()
        ctld = f"{self.hosts[0].name}({self.hosts[0].addr})" if self.hosts else f"{host}(127.0.0.1)"
        # One slurmd per host: its own spool, pid and log files (%n: its node name).
        n = "-%n" if self.hosts else ""
        if self.hosts:
            nodes = "".join(f"NodeName={h.name} NodeHostname={h.name} NodeAddr={h.addr} "
                            f"CPUs={self.cpus} State=UNKNOWN\n" for h in self.hosts)
        else:
            nodes = (f"NodeName={self.node} NodeHostname={host} NodeAddr=127.0.0.1 "
                     f"CPUs={self.cpus} State=UNKNOWN\n")
        conf = f"""ClusterName=astraitest
SlurmctldHost={ctld}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self._path("munge", "munge.sock")}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self._path("state")}
SlurmdSpoolDir={self._path("spool" + n)}
SlurmctldPidFile={self._path("slurmctld.pid")}
SlurmdPidFile={self._path(f"slurmd{n}.pid")}
SlurmctldLogFile={self._path("slurmctld.log")}
SlurmdLogFile={self._path(f"slurmd{n}.log")}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=30
SchedulerParameters=sched_interval=1
{nodes}PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def start(self):
        missing = [b for b in BINARIES if not find(b)]
        if missing:
            raise Unavailable(f"not installed: {', '.join(missing)} (Debian slurm-wlm, munge)")
        if os.geteuid() != 0:
            raise Unavailable("the test cluster's slurmd runs as root")
        spools = [f"spool-{n}" for n in self.nodes] if self.hosts else ["spool"]
        for d in ("state", "munge", *spools):
            os.makedirs(self._path(d), exist_ok=True)
        os.chmod(self._path("munge"), 0o700)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self._start_munged()
        self._write_conf(tu.free_port(), tu.free_port())
        self._start_ctld()
        if self.hosts:
            for h in self.hosts:
                self._daemon([find("slurmd"), "-D", "-f", self.conf, "-N", h.name],
                             f"slurmd-{h.name}", h)
        else:
            self._daemon([find("slurmd"), "-D", "-f", self.conf, "-N", self.node], "slurmd")
        self._wait(self._nodes_idle, "slurmd (nodes idle)", timeout=60)

    def _start_ctld(self):
        """slurmctld (on hosts[0] where there are hosts)."""
        self._daemon([find("slurmctld"), "-D", "-i", "-f", self.conf], "slurmctld",
                     self.hosts[0] if self.hosts else None)

    def _daemon(self, argv, name, host=None):
        """Starts a daemon (inside host, if given), its output in <name>.out."""
        log = open(self._path(f"{name}.out"), "ab")
        popen = host.popen if host else subprocess.Popen
        self.procs.append((name, popen(argv, stdout=log, stderr=log, env=self.env,
                                       start_new_session=True)))
        log.close()

    def node_states(self):
        """{node name: Slurm's short state word} of every node sinfo lists."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        return dict(line.split() for line in out.stdout.splitlines()) if out.returncode == 0 else {}

    def _nodes_idle(self):
        return self.node_states() == {n: "idle" for n in self.nodes}

    def _wait(self, ready, what, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise Unavailable(f"{name} exited with {p.returncode}: {self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        tails = "".join(f"\n--- {n} ---\n{self.log_tail(n)}" for n, _ in self.procs)
        raise Unavailable(f"{what} not ready within {timeout} s:{tails}")

    def log_tail(self, name, n=2000):
        text = ""
        for path in (self._path(f"{name}.out"), self._path(f"{name}.log")):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    text += f.read().decode(errors="replace")[-n:]
        return text

    def run(self, *args, check=True):
        out = subprocess.run(self.argv(args), env=self.env, capture_output=True, text=True,
                             timeout=60)
        if check and out.returncode:
            raise AssertionError(f"{' '.join(args)}: {out.stdout}{out.stderr}")
        return out

    def jobs(self):
        """The ids of the jobs Slurm lists as pending or running."""
        out = self.run("squeue", "--noheader", "--format=%i")
        return [int(x) for x in out.stdout.split()]

    def _stop_one(self, name):
        for n, p in self.procs:
            if n == name:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
        self.procs = [(n, p) for n, p in self.procs if n != name]

    def stop_ctld(self):
        """Stops slurmctld alone (tests of 'slurmctld down'); its state stays on disk."""
        self._stop_one("slurmctld")

    def start_ctld(self):
        """Starts slurmctld again (it reads back its jobs from its state directory)."""
        self._start_ctld()
        self._wait(lambda: self.run("sinfo", check=False).returncode == 0, "slurmctld")

    def stop_munge(self):
        """Stops munged alone: every Slurm command then fails to authenticate; the daemons
        and the jobs they run go on."""
        self._stop_one("munged")

    def start_munge(self):
        """Starts munged again; returns once Slurm commands answer."""
        self._start_munged()
        self._wait(lambda: self.run("sinfo", check=False).returncode == 0, "munge")

    def _start_munged(self):
        """munged with the cluster's key, on the cluster's socket."""
        sock = self._path("munge", "munge.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        self._daemon([find("munged"), "--foreground",
                      f"--key-file={self._path('munge', 'munge.key')}", f"--socket={sock}",
                      f"--pid-file={self._path('munge', 'munged.pid')}",
                      f"--log-file={self._path('munge', 'munged.log')}",
                      f"--seed-file={self._path('munge', 'seed')}", "--force"], "munged")
        self._wait(lambda: os.path.exists(sock), "munged")

    def create_partition(self, name):
        """A partition of every node (up), next to the default one."""
        self.run("scontrol", "create", f"PartitionName={name}", "Nodes=ALL", "State=UP")

    def delete_partition(self, name, timeout=60):
        """Deletes a partition once no job is in it any more (Slurm refuses while one is,
        also while a finished one is still completing)."""
        deadline = time.time() + timeout
        while True:
            out = self.run("scontrol", "delete", f"PartitionName={name}", check=False)
            if out.returncode == 0:
                return
            if "in use" not in out.stdout + out.stderr or time.time() > deadline:
                raise AssertionError(f"scontrol delete PartitionName={name}: "
                                     f"{out.stdout}{out.stderr}")
            time.sleep(0.2)

    def stop(self):
        if self.procs and find("scancel"):
            subprocess.run(self.argv(["scancel", "--full", "--user=root"]), env=self.env,
                           capture_output=True, timeout=30)
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs = []
        for n in self.nodes if self.hosts else [""]:
            shutil.rmtree(self._path("spool" + (n and f"-{n}")), ignore_errors=True)


def main(run):
    """A test's main: run(root, cluster) on a new cluster in a new directory; 77 (skipped, with
    the reason) where Slurm cannot run here."""
    root = tu.tmpdir()
    try:
        cluster = Cluster(root).__enter__()
    except Unavailable as e:
        print(f"skipped: Slurm cannot run here: {e}")
        return 77
    try:
        run(root, cluster)
    finally:
        cluster.stop()
    print("ok")
    return 0
