"""Helpers of the launch tests: run tests/launch_probe.c (a stand-in for astrai-train
built on the same launch API), read what its ranks reported, watch real processes."""

import os
import signal
import socket
import subprocess
import tempfile
import time

PROBE = os.path.join(os.environ["ASTRAI_BUILD"], "launch_probe")

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


def alive(pid):
    """True while pid runs (a zombie counts as gone: it runs nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


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
