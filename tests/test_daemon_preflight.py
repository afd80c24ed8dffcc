"""astraid's preflight (issue 23 §4) on real file systems and the fake NVML library: a ckpt_dir
on a tmpfs smaller than a checkpoint fails the job (and `astraictl preflight job.json` says so,
with the numbers, before any submit); one with too little space free keeps the job waiting, its
error giving the numbers, until space is freed, then it runs; the estimate is checked against
the checkpoint written. On GPUs: another process holding memory on the job's GPU makes it wait,
uncorrected ECC errors or a pending page retirement fail it. Mounting needs root: a mount that
fails fails the test."""

import json
import os
import subprocess
import sys

import daemon_util as du
import test_launch_util as lu
import train_util as tu

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def mount_tmpfs(path, size):
    os.makedirs(path)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"mount -t tmpfs {path} failed (the test needs root): {p.stderr}"


def astraictl_preflight(d, root, spec):
    path = os.path.join(root, "job.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", "preflight", path],
                       capture_output=True, text=True, timeout=60)
    print(f"astraictl preflight (exit {p.returncode}):\n{p.stdout}{p.stderr}", end="")
    return p


def checkpoint_bytes(ckpt):
    return sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))


def check_never_fits(d, c, root, model, data, small):
    spec = du.spec(model, data, ckpt_dir=os.path.join(small, "ck"))
    p = astraictl_preflight(d, root, spec)
    assert p.returncode == 4, p
    assert p.stdout.startswith("preflight: fail: ckpt_dir ") and "512.0 KiB in all" in p.stdout \
        and "can never fit" in p.stdout, p.stdout
    report = c.call("preflight", spec)
    disk = report["disk"]
    assert report["verdict"] == "fail" and disk["total_bytes"] == 512 * KIB, report
    assert disk["checkpoint_bytes"] > disk["total_bytes"], report
    jid = c.call("submit", spec)["job"]
    failed = du.wait_job(c, jid, ["failed"])
    print(f"job {jid}: {failed['error']}")
    assert "can never fit" in failed["error"] and "512.0 KiB in all" in failed["error"], failed
    assert failed["restarts"] == 0 and failed["step"] == 0, failed


def check_waits_for_space(d, c, root, model, data, mount):
    filler = os.path.join(mount, "filler")
    with open(filler, "wb") as f:  # leaves less than a checkpoint free
        f.write(b"\0" * (3 * MIB + 512 * KIB))
    spec = du.spec(model, data, n_epoch=2, ckpt_dir=os.path.join(mount, "ck"))
    report = c.call("preflight", spec)
    disk = report["disk"]
    print(f"preflight with the filler: {report['reason']}")
    assert report["verdict"] == "wait" and disk["free_bytes"] < disk["checkpoint_bytes"], report
    assert f"{disk['parameters']} parameters" in report["reason"], report
    jid = c.call("submit", spec)["job"]
    waiting = du.wait_job(c, jid, ["queued"], pred=lambda j: j["error"] and
                          "preflight: ckpt_dir" in j["error"])
    print(f"job {jid} waits: {waiting['error']}")
    assert "free of 4.0 MiB" in waiting["error"] and waiting["step"] == 0, waiting
    os.unlink(filler)
    done = du.wait_job(c, jid, ["completed"])
    real = checkpoint_bytes(done["last_checkpoint"])
    est = disk["checkpoint_bytes"]
    print(f"job {jid} completed once space was freed: checkpoint {real} bytes, estimated {est}")
    assert real <= est <= real * 1.15, (real, est)


def check_disk(root):
    model, data = du.make_setup(root)
    small, roomy = os.path.join(root, "small"), os.path.join(root, "roomy")
    mount_tmpfs(small, "512k")
    try:
        mount_tmpfs(roomy, "4m")
        try:
            d = du.Daemon(root).start()
            with du.guarded(d):
                c = d.client()
                check_never_fits(d, c, root, model, data, small)
                check_waits_for_space(d, c, root, model, data, roomy)
                c.close()
                assert d.stop() == 0
        finally:
            subprocess.run(["umount", roomy], check=True)
    finally:
        subprocess.run(["umount", small], check=True)


# MEMORY_TOTAL MEMORY_USED UTILIZATION_PCT PROCESS_BYTES [health words] NAME
GPUS = ["141000000000 3000000000 10 1073741824 retired=0 pending=0 ecc=2 Fake sick ECC",
        "141000000000 3000000000 10 1073741824 retired=0 pending=0 ecc=0 Fake healthy",
        "141000000000 3000000000 10 1073741824 retired=3 pending=1 ecc=0 Fake pending"]


def gpu_spec(model, data, gpu):
    return du.spec(model, data, device_type="cpu", devices=f"cuda:{gpu}")


def check_gpus(root):
    model, data = du.make_setup(root)
    gpus_file = os.path.join(root, "gpus.txt")
    with open(gpus_file, "w") as f:
        f.write("\n".join(GPUS) + "\n")
    env = {"LD_LIBRARY_PATH": os.path.join(os.environ["ASTRAI_BUILD"], "fake_nvml"),
           "FAKE_NVML_FILE": gpus_file}
    d = du.Daemon(root, env=env)
    d.args = [a for a in d.args if not a.startswith("--devices=")]  # NVML's GPUs
    d.start()
    # A process that is no rank of astraid's on GPU 1 (the fake NVML finds it by its
    # CUDA_VISIBLE_DEVICES, as the driver would by its context).
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"))
    try:
        with du.guarded(d):
            check_gpu_verdicts(d, model, data, other)
    finally:
        other.kill()
        other.wait()


def check_gpu_verdicts(d, model, data, other):
    """Sick GPUs fail their jobs; a busy one keeps its job waiting until the process exits."""
    c = d.client()
    for gpu, want in ((0, "cuda:0 is sick: 2 uncorrected ECC error(s)"),
                      (2, "cuda:2 is sick: a page retirement is pending (3 retired)")):
        report = c.call("preflight", gpu_spec(model, data, gpu))
        print(f"cuda:{gpu}: {report['verdict']}: {report['reason']}")
        assert report["verdict"] == "fail" and want in report["reason"], report
        jid = c.call("submit", gpu_spec(model, data, gpu))["job"]
        failed = du.wait_job(c, jid, ["failed"])
        assert want in failed["error"], failed
    report = lu.wait_for("the other process seen on cuda:1", lambda: (
        r := c.call("preflight", gpu_spec(model, data, 1)))["verdict"] == "wait" and r)
    (g,) = report["gpus"]
    print(f"cuda:1: wait: {report['reason']}")
    assert g["other_processes"] == [{"pid": other.pid, "memory_bytes": GIB}], g
    assert f"pid {other.pid} (1.0 GiB)" in report["reason"], report
    assert g["ecc_uncorrected_volatile"] == 0 and g["retirement_pending"] is False, g
    jid = c.call("submit", gpu_spec(model, data, 1))["job"]
    du.wait_job(c, jid, ["queued"], pred=lambda j: j["error"] and
                f"pid {other.pid}" in j["error"])
    other.kill()
    other.wait()
    du.wait_job(c, jid, ["completed"])
    print(f"job {jid} on cuda:1 completed once pid {other.pid} exited")
    assert c.call("preflight", gpu_spec(model, data, 1))["verdict"] == "ok"
    c.close()
    assert d.stop() == 0


def main():
    root = tu.tmpdir()
    for sub in ("disk", "gpu"):
        os.makedirs(os.path.join(root, sub))
    check_disk(os.path.join(root, "disk"))
    check_gpus(os.path.join(root, "gpu"))
    print("ok")


if __name__ == "__main__":
    main()
