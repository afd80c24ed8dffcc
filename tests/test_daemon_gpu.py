"""astraid's GPUs: counted and sampled through NVML, handed to jobs as disjoint devices, and
reported per rank (daemon.info "gpus", the JOB's "ranks", astraictl status).

Real NVML needs an NVIDIA driver and GPUs, which the machines that run this suite do not
have, so astraid loads a stand-in libnvidia-ml.so.1 built from tests/fake_nvml.c (NVML's real
signatures and structs, through astraid's own dlopen/dlsym path) found via LD_LIBRARY_PATH. It
describes the GPUs of the file $FAKE_NVML_FILE and reports a process as running on GPU i when
the LOCAL_RANK-th entry of its CUDA_VISIBLE_DEVICES is i, using that GPU's PROCESS_BYTES. The
ranks themselves train on the CPU (no CUDA here): only what astraid hands out and reports is
checked. A second daemon uses the fake without nvmlDeviceGetComputeRunningProcesses_v3 (an
older driver); a third has NVML failing to initialise (CPU slots, no GPUs)."""

import json
import os
import time

import daemon_util as du
import train_util as tu

GIB = 1 << 30
# MEMORY_TOTAL MEMORY_USED UTILIZATION_PCT PROCESS_BYTES NAME
GPUS = [(141 * GIB, 3 * GIB, 87, 1 * GIB, "Fake H200 zero"),
        (141 * GIB, 5 * GIB, 42, 2 * GIB, "Fake H200 one")]


def spec(model, data, **extra):
    """A job spec whose ranks compute on the CPU whatever they see (no CUDA here)."""
    return du.spec(model, data, device_type="cpu", **extra)


def write_gpus(path, gpus):
    with open(path + ".tmp", "w") as f:
        f.write("# total used util process_bytes name\n")
        for total, used, util, proc, name in gpus:
            f.write(f"{total} {used} {util} {proc} {name}\n")
    os.replace(path + ".tmp", path)


def environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(x.decode().split("=", 1) for x in items if b"=" in x)


def start_daemon(root, lib_dir, gpus_file, devices=None):
    env = {"LD_LIBRARY_PATH": os.path.join(os.environ["ASTRAI_BUILD"], lib_dir)}
    if gpus_file:
        env["FAKE_NVML_FILE"] = gpus_file
    os.makedirs(root, exist_ok=True)
    d = du.Daemon(root, env=env)
    d.args = [a for a in d.args if not a.startswith("--devices=")]  # NVML decides
    if devices:
        d.args.append(f"--devices={devices}")
    return d.start()


def running_ranks(c, jid, pred, timeout=30):
    """Waits (the GPU sample is at most 2 s old) until pred holds for the job's ranks."""
    deadline = time.time() + timeout
    while True:
        job = du.wait_job(c, jid, ["running"])
        if job["ranks"] and all(r["pid"] for r in job["ranks"]) and pred(job["ranks"]):
            return job
        assert time.time() < deadline, f"job {jid}: ranks never matched: {job['ranks']}"
        time.sleep(0.2)


def gpu_figures(ranks):
    """Each rank shows the figures of its GPU in GPUS."""
    return all(r["gpu"] is not None and r["memory_used_bytes"] == GPUS[r["gpu"]][3] and
               r["utilization_pct"] == GPUS[r["gpu"]][2] for r in ranks)


def check_info(c):
    info = c.call("daemon.info")
    assert [x["id"] for x in info["devices"]] == ["cuda:0", "cuda:1"], info
    want = [{"index": i, "name": name, "memory_total_bytes": total, "memory_used_bytes": used,
             "utilization_pct": util} for i, (total, used, util, _, name) in enumerate(GPUS)]
    assert info["gpus"] == want, info["gpus"]


def check_disjoint(d, c, model, data):
    """Two 1-GPU jobs run at once on GPUs 0 and 1; a 2-GPU job waits for both."""
    a = c.call("submit", spec(model, data, n_epoch=400, name="a"))["job"]
    b = c.call("submit", spec(model, data, n_epoch=400, name="b"))["job"]
    ja = running_ranks(c, a, gpu_figures)
    jb = running_ranks(c, b, gpu_figures)
    seen = set()
    for job in (ja, jb):
        (rank,) = job["ranks"]
        env = environ(rank["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == str(rank["gpu"]), (env, rank)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", env
        assert job["devices"] == [f"cuda:{rank['gpu']}"], job
        assert rank["rank"] == 0 and rank["pid"] in du.rank_pids(d.state_dir, job["id"]), rank
        seen.add(env["CUDA_VISIBLE_DEVICES"])
    assert seen == {"0", "1"}, seen
    busy = {x["id"]: x["busy_job"] for x in c.call("daemon.info")["devices"]}
    assert sorted(busy.values()) == sorted([a, b]), busy

    # a and b held: neither ends (freeing its GPU) on its own meanwhile. The queue is looked
    # at as a submit is answered and as a run's end is decided: no wait makes these surer.
    with du.hold(c, a), du.hold(c, b):
        both = c.call("submit", spec(model, data, n_epoch=400, devices=2, parallel_mode="ddp",
                                        batch_per_device=2, name="both"))["job"]
        assert c.call("status", {"job": both})["state"] == "queued"
        assert c.call("status", {"job": both})["ranks"] == []
        c.call("cancel", {"job": a})
        du.wait_run_ended(d.state_dir, a)  # one GPU free is not enough
        busy = {x["id"]: x["busy_job"] for x in c.call("daemon.info")["devices"]}
        assert busy == {ja["devices"][0]: None, jb["devices"][0]: b}, busy
        assert c.call("status", {"job": both})["state"] == "queued"
    c.call("cancel", {"job": b})
    jboth = running_ranks(c, both, gpu_figures)
    assert [r["gpu"] for r in jboth["ranks"]] == [0, 1], jboth["ranks"]
    assert jboth["devices"] == ["cuda:0", "cuda:1"], jboth
    for r in jboth["ranks"]:
        env = environ(r["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["LOCAL_RANK"] == str(r["rank"]), env
    c.call("cancel", {"job": both})
    du.wait_gone([r["pid"] for r in jboth["ranks"]], 20)
    return both


def check_named_gpu(d, c, model, data, gpus_file):
    """"devices": "cuda:1" gets GPU 1; status (JSON and astraictl) shows its figures."""
    jid = c.call("submit", spec(model, data, n_epoch=400, devices="cuda:1"))["job"]
    job = running_ranks(c, jid, gpu_figures)
    with du.hold(c, jid):  # it runs on, whatever the machine's speed, until cancelled
        (rank,) = job["ranks"]
        assert rank["gpu"] == 1 and job["devices"] == ["cuda:1"], job
        assert environ(rank["pid"])["CUDA_VISIBLE_DEVICES"] == "1"
        assert rank["memory_used_bytes"] == 2 * GIB and rank["utilization_pct"] == 42, rank

        ctl = [tu.binary("astraictl"), "--socket", d.socket]
        out, _ = tu.run(ctl + ["status", str(jid)])
        assert f"rank 0  cuda:1  2.0 GiB  42%  pid {rank['pid']}" in out, out
        out, _ = tu.run(ctl + ["status", str(jid), "--json"])
        assert json.loads(out)["ranks"][0]["gpu"] == 1, out
        out, _ = tu.run(ctl + ["daemon"])
        assert "gpu 1  Fake H200 one  5.0/141.0 GiB  42%" in out, out

        # The sample follows the GPUs: utilisation NVML cannot read is null, then "-".
        write_gpus(gpus_file, [GPUS[0], GPUS[1][:2] + ("-",) + GPUS[1][3:]])
        job = running_ranks(c, jid, lambda ranks: ranks[0]["utilization_pct"] is None)
        assert job["ranks"][0]["memory_used_bytes"] == 2 * GIB, job["ranks"]
        assert c.call("daemon.info")["gpus"][1]["utilization_pct"] is None
        assert "gpu 1: NVML nvmlDeviceGetUtilizationRates failed: Not Supported" in d.logs()
        out, _ = tu.run(ctl + ["status", str(jid)])
        assert "rank 0  cuda:1  2.0 GiB  -  pid" in out, out
        write_gpus(gpus_file, GPUS)

        # A job on the other GPU runs beside it.
        other = c.call("submit", spec(model, data, n_epoch=400, devices=1))["job"]
        jo = running_ranks(c, other, gpu_figures)
        assert jo["ranks"][0]["gpu"] == 0, jo
        for j in (jid, other):
            c.call("cancel", {"job": j})

    du.expect_error(lambda: c.call("submit", spec(model, data, devices="cuda:7")), -32602,
                    "devices", "no device 7")
    du.expect_error(lambda: c.call("submit", spec(model, data, devices="gpu:1")), -32602,
                    "devices", "gpu:1")
    du.expect_error(lambda: c.call("submit", spec(model, data, devices="cuda:1,1",
                                                     parallel_mode="ddp")),
                    -32602, "listed twice")


def check_legacy_processes(root, model, data, gpus_file):
    """A driver without the _v3 call: the legacy struct gives the same figures."""
    d = start_daemon(root, "fake_nvml_v1", gpus_file)
    with du.guarded(d):
        c = d.client()
        check_info(c)
        assert "processes from nvmlDeviceGetComputeRunningProcesses (legacy)" in d.logs()
        jid = c.call("submit", spec(model, data, n_epoch=400))["job"]
        job = running_ranks(c, jid, gpu_figures)
        assert job["ranks"][0]["gpu"] == 0 and job["ranks"][0]["memory_used_bytes"] == GIB, job
        c.call("cancel", {"job": jid})
        c.close()
        assert d.stop() == 0


def check_no_gpus(root, model, data):
    """NVML that cannot start: CPU slots, no gpus, ranks without a GPU."""
    d = start_daemon(root, "fake_nvml", os.path.join(root, "missing"), devices="cpu:1")
    with du.guarded(d):
        c = d.client()
        info = c.call("daemon.info")
        assert info["gpus"] == [] and info["devices"][0]["id"] == "cpu:0", info
        assert "nvmlInit_v2 failed: Driver Not Loaded" in d.logs(), d.logs()
        du.expect_error(lambda: c.call("submit", spec(model, data, devices="cuda:0")),
                        -32602, "asks for GPUs")
        jid = c.call("submit", spec(model, data, n_epoch=400))["job"]
        job = running_ranks(c, jid, lambda ranks: True)
        (rank,) = job["ranks"]
        assert rank["gpu"] is None and rank["memory_used_bytes"] is None, rank
        assert rank["utilization_pct"] is None and rank["pid"] > 0, rank
        assert environ(rank["pid"])["CUDA_VISIBLE_DEVICES"] == ""
        out, _ = tu.run([tu.binary("astraictl"), "--socket", d.socket, "status", str(jid)])
        assert f"rank 0  cpu  pid {rank['pid']}" in out, out
        c.call("cancel", {"job": jid})
        c.close()
        assert d.stop() == 0


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    gpus_file = os.path.join(root, "gpus.txt")
    write_gpus(gpus_file, GPUS)
    d = start_daemon(os.path.join(root, "d1"), "fake_nvml", gpus_file)
    with du.guarded(d):
        c = d.client()
        check_info(c)
        assert "processes from nvmlDeviceGetComputeRunningProcesses_v3" in d.logs()
        check_disjoint(d, c, model, data)
        check_named_gpu(d, c, model, data, gpus_file)
        c.close()
        assert d.stop() == 0
    check_legacy_processes(os.path.join(root, "d2"), model, data, gpus_file)
    check_no_gpus(os.path.join(root, "d3"), model, data)
    print("ok")


if __name__ == "__main__":
    main()
