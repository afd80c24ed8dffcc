"""Helpers of the launch tests: run tests/launch_probe.c (a stand-in for astrai-train
built on the same launch API), read what its ranks reported, watch real processes. Also the
waits every process test shares (they import no torch): for a condition, for a process to
sleep in nanosleep or a port to listen, and Held, processes stopped while a test looks."""

import os
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time

PROBE = os.path.join(os.environ.get("ASTRAI_BUILD", os.path.join(os.path.dirname(__file__), "..",
                                                                "build")), "launch_probe")

# Variables that would change how the probe is launched; the tests set their own.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "ASTRAI_"))}
    env["ASAN_OPTIONS"] = "detect_leaks=1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(out, *args, env=None):
    """The probe as a real process; stderr is captured for the messages."""
    return subprocess.Popen([PROBE, f"--out={out}", *args], env=env or clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=30):
    """(exit code, stderr); a probe that does not end in time fails the test."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"probe did not exit within {timeout} s; stderr:\n{err}")
    return proc.returncode, err


def read_report(path):
    with open(path) as f:
        return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


def wait_reports(out, n, proc=None, timeout=15):
    """{rank: report} once all n ranks wrote theirs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        paths = [os.path.join(out, f"rank{r}.txt") for r in range(n)]
        if all(os.path.exists(p) for p in paths):
            return {r: read_report(p) for r, p in enumerate(paths)}
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited {proc.returncode} early: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"not every rank of {n} reported within {timeout} s: {os.listdir(out)}")


def proc_state(pid):
    """The state letter of /proc/PID/stat (R, S, D, T, Z, ...); None when pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid):
    """True while pid runs (a zombie counts as gone: it runs nothing any more)."""
    return proc_state(pid) not in (None, "Z", "X")


def wait_for(what, pred, timeout=60, interval=0.05):
    """pred()'s value once it is true; fails naming `what` when it is not within timeout
    seconds (generous: a slow, loaded machine only makes the wait longer)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(interval)


def wait_sleeping(pid, timeout=60):
    """Until pid sleeps in nanosleep (its kernel wait channel says so; where the kernel hides
    it, until pid sleeps at all): it reached the pause of a retry loop."""
    def sleeping():
        assert alive(pid), f"pid {pid} ended before it slept"
        try:
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip()
        except FileNotFoundError:
            return False
        return "nanosleep" in wchan or (wchan in ("", "0") and proc_state(pid) == "S")
    wait_for(f"pid {pid} sleeps in nanosleep", sleeping, timeout, 0.01)


def listening(port):
    """True when a TCP socket of this machine listens on port (/proc/net/tcp, tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except FileNotFoundError:
            continue
        if any(r[1].rsplit(":", 1)[1] == f"{port:04X}" and r[3] == "0A" for r in rows):
            return True
    return False


def wait_listening(port, proc, timeout=60):
    """Until something listens on port, failing at once if proc (a Popen) exits first."""
    def up():
        assert proc.poll() is None, f"{proc.args[0]} exited {proc.returncode} before it listened"
        return listening(port)
    wait_for(f"a listener on port {port}", up, timeout, 0.01)


def children(pid):
    """The pids of pid's child processes (a launcher's ranks)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError):
                pass
    return out


def progress_value(progress_db, sql):
    """The first value sql selects from a run's progress.db; None when it selects nothing
    (or there is no such database yet)."""
    try:
        db = sqlite3.connect(f"file:{progress_db}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute(sql).fetchone()
        finally:
            db.close()
    except sqlite3.OperationalError:  # not created yet
        return None
    return row[0] if row else None


def last_step(progress_db):
    """The last step in the steps table of a run's progress.db; 0 before there is one."""
    return progress_value(progress_db, "SELECT max(step) FROM steps") or 0


class Held:
    """Processes stopped with SIGSTOP (each seen stopped when the constructor returns) until
    release() or the end of a with block (also when the test fails) continues them. Ranks
    held cannot finish their job however fast the machine: a test that needs a job still
    running, or to act on it at a known step, holds its ranks. A signal they get meanwhile
    (a stop's SIGTERM) waits for the release; SIGKILL does not."""

    def __init__(self, pids):
        self.pids = list(pids)

        def stopped():
            states = [proc_state(p) for p in self.pids]
            assert all(s not in (None, "Z", "X") for s in states), \
                f"processes {self.pids} ended before they were held ({states})"
            return all(s in ("T", "t") for s in states)
        try:
            for p in self.pids:
                os.kill(p, signal.SIGSTOP)
            wait_for(f"processes {self.pids} stopped", stopped, interval=0.01)
        except BaseException:
            self.release()
            raise

    def wait_signal(self, sig, timeout=60):
        """Until sig waits (pending) on one of the held processes: sent while they are
        stopped (a scancel's, say), it takes effect once they are released."""
        bit = 1 << (sig - 1)

        def pending():
            for p in self.pids:
                try:
                    with open(f"/proc/{p}/status") as f:
                        masks = [int(line.split()[1], 16) for line in f
                                 if line.startswith(("SigPnd:", "ShdPnd:"))]
                except FileNotFoundError:
                    continue
                if any(m & bit for m in masks):
                    return True
            return False
        wait_for(f"signal {sig} sent to one of {self.pids}", pending, timeout, 0.01)

    def release(self):
        for p in self.pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.pids = []

    def advance_until(self, what, pred, timeout=60):
        """Lets the processes run until pred() is true, then stops them again; returns
        pred()'s value (they stop a little after it is seen)."""
        pids = self.pids
        self.release()
        got = wait_for(what, pred, timeout, 0.002)
        self.__init__(pids)
        return got

    def advance(self, progress_db, to=None, timeout=60):
        """advance_until the steps table of progress_db (a rank's progress.db) reaches step
        `to` (by default one past its last step now); returns the last step then (it may be a
        step or two past)."""
        target = to if to is not None else last_step(progress_db) + 1
        self.advance_until(f"step {target} in {progress_db}",
                           lambda: last_step(progress_db) >= target, timeout)
        return last_step(progress_db)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def wait_gone(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leave them behind even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes {left} still alive after {timeout} s"


def shm_segments(name):
    """What /dev/shm holds of one run's segment name ("/astrai-...")."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(name.lstrip("/"))]


def free_port(count=1):
    """A port p such that p..p+count-1 are free right now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count > 65535:
            continue
        try:
            for i in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue


def run_tests(namespace):
    """Runs every test_* function of a test module (a fresh temp dir each), by name."""
    for name, test in sorted(namespace.items()):
        if name.startswith("test_") and callable(test):
            with tempfile.TemporaryDirectory() as tmp:
                test(tmp)
            print(f"ok {name}")
