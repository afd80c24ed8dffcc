"""astraid's /metrics read by the real tools: `promtool check metrics` accepts the text, and
a real Prometheus server scraping astraid every second returns through its HTTP API the
loss `status` shows for a job that trained. Also: the job's series (one-hot state, step,
escaped labels), GPU memory and utilisation from NVML's samples (a stand-in
libnvidia-ml.so.1, as in test_daemon_gpu.py), the request counters moving with the requests made (unknown methods
under one label value), a mixture of experts' load extremes (status, /metrics and `astraictl
status` say the newest step's, as its progress.db's expert_load table gives them; a dense job
has none), astrai_job_restarts_total never going down (a resume resets the
restarts of status, not the counter), and the listener's token rule (a non-loopback --http needs
--token-file; off loopback, 401 without or with a wrong bearer token, except for the page
itself).

Skipped (exit 77) only when prometheus or promtool is not installed."""

import json
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.parse

import daemon_util as du
import test_launch_util as lu
import train_util as tu
from test_daemon_gpu import GIB, GPUS, write_gpus
from test_daemon_http import http_get, http_setup, timed

SKIP = 77
NAME = 'we"ird\\name'  # a job name that needs escaping in a label
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{(name, frozenset of (label, value)): value} of the samples of an exposition text."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset((k, re.sub(r'\\(.)', lambda e: {"n": "\n"}.get(e[1], e[1]), v))
                           for k, v in LABEL.findall(m[3] or ""))
        out[(m[1], labels)] = float(m[4])
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def scrape(port):
    status, headers, body = http_get(port, "/metrics")
    assert status == 200, status
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8", headers
    return body.decode()


def check_promtool(text):
    r = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                       capture_output=True, timeout=60)
    assert r.returncode == 0, f"promtool check metrics:\n{r.stdout.decode()}{r.stderr.decode()}"


def check_job_series(samples, st):
    job = st["id"]
    states = ["queued", "starting", "running", "pausing", "paused", "completed", "failed",
              "cancelled", "interrupted"]
    for s in states:
        want = 1.0 if s == st["state"] else 0.0
        got = value(samples, "astrai_job_state", job_id=job, job_name=NAME, state=s)
        assert got == want, f"astrai_job_state{{state={s}}} {got}, want {want}"
    assert value(samples, "astrai_job_step", job_id=job, job_name=NAME) == st["step"]
    assert value(samples, "astrai_job_total_steps", job_id=job, job_name=NAME) == \
        st["total_steps"]
    assert math.isclose(value(samples, "astrai_job_loss", job_id=job, job_name=NAME),
                        st["loss"], rel_tol=1e-15)
    assert math.isclose(value(samples, "astrai_job_learning_rate", job_id=job, job_name=NAME),
                        st["lr"], rel_tol=1e-15)
    assert value(samples, "astrai_job_restarts_total", job_id=job, job_name=NAME) == \
        st["restarts"]
    ckpt = value(samples, "astrai_job_last_checkpoint_timestamp_seconds", job_id=job,
                 job_name=NAME)
    assert ckpt is not None and abs(ckpt - os.stat(st["last_checkpoint"]).st_mtime) < 1e-3
    assert value(samples, "astrai_jobs", state="completed") == 1
    assert value(samples, "astrai_device_busy", device="cpu:0") == 0


def check_requests(port, c, job):
    """Each request counts under its method and code; unknown methods share "other"."""
    before = parse(scrape(port))
    ok = value(before, "astrai_requests_total", method="status", code=0) or 0
    count = value(before, "astrai_request_duration_seconds_count")
    for _ in range(5):
        c.call("status", {"job": job})
    du.expect_error(lambda: c.call("status", {"job": 4242}), -32001)
    for name in ["bogus.one", "bogus.two"]:
        du.expect_error(lambda: c.call(name), -32601)
    # Answered later (read off the loop): counted once answered, with its answer's code.
    hist = value(before, "astrai_requests_total", method="history", code=0) or 0
    c.call("history", {"job": job})
    after = parse(scrape(port))  # counted before each answer went out: no wait
    assert value(after, "astrai_requests_total", method="status", code=0) == ok + 5
    assert value(after, "astrai_requests_total", method="history", code=0) == hist + 1
    assert value(after, "astrai_requests_total", method="status", code=-32001) == 1
    assert (value(after, "astrai_requests_total", method="other", code=-32601) or 0) >= 2
    assert not any("bogus" in v for (_, labels) in after for _, v in labels), \
        "an unknown method name became a label value"
    assert value(after, "astrai_request_duration_seconds_count") == count + 9
    assert value(after, "astrai_request_duration_seconds_bucket", le="+Inf") == count + 9


def prometheus_query(port, query):
    q = urllib.parse.quote(query)
    status, _, body = http_get(port, f"/api/v1/query?query={q}")
    assert status == 200, body
    return json.loads(body)["data"]["result"]


def check_prometheus(root, port, st):
    prom_port = tu.free_port()
    config = os.path.join(root, "prometheus.yml")
    with open(config, "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: astraid
    static_configs:
      - targets: ["127.0.0.1:{port}"]
""")
    log = open(os.path.join(root, "prometheus.log"), "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={config}",
                             f"--storage.tsdb.path={os.path.join(root, 'tsdb')}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=log)
    try:
        query = f'astrai_job_loss{{job_id="{st["id"]}"}}'
        deadline, result = time.time() + 45, []
        while time.time() < deadline and not result:
            assert prom.poll() is None, f"prometheus exited {prom.returncode}"
            try:
                result = prometheus_query(prom_port, query)
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        assert result, f"prometheus has no {query} after 45 s"
        assert len(result) == 1, result
        assert result[0]["metric"]["job_name"] == NAME, result[0]["metric"]
        assert math.isclose(float(result[0]["value"][1]), st["loss"], rel_tol=1e-15), \
            (result[0]["value"], st["loss"])
        up = prometheus_query(prom_port, 'up{job="astraid"}')
        assert up and up[0]["value"][1] == "1", up
    except BaseException:
        log.flush()
        with open(log.name, "rb") as f:
            print(f.read().decode(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


def check_gpus(root):
    """GPU memory and utilisation from NVML's samples: the stand-in libnvidia-ml.so.1 of
    tests/test_daemon_gpu.py describes two GPUs; a change of its file shows within a sample."""
    gpus_file = os.path.join(root, "gpus.txt")
    gpus = [list(g) for g in GPUS]
    write_gpus(gpus_file, gpus)
    port = tu.free_port()
    os.makedirs(os.path.join(root, "gpu"))
    d = du.Daemon(os.path.join(root, "gpu"), args=[f"--http=127.0.0.1:{port}"],
                  env={"LD_LIBRARY_PATH": os.path.join(os.environ["ASTRAI_BUILD"], "fake_nvml"),
                       "FAKE_NVML_FILE": gpus_file})
    d.args = [a for a in d.args if not a.startswith("--devices=")]  # the GPUs NVML finds
    d.start()
    with du.guarded(d):
        samples = parse(scrape(port))
        for i, (_, used, util, _, _) in enumerate(gpus):
            dev = f"cuda:{i}"
            assert value(samples, "astrai_gpu_memory_used_bytes", device=dev) == used, dev
            assert value(samples, "astrai_gpu_utilization_ratio", device=dev) == util / 100, dev
            assert value(samples, "astrai_device_busy", device=dev) == 0, dev
            assert value(samples, "astrai_device_job_id", device=dev) == 0, dev
        gpus[1][1], gpus[1][2] = 7 * GIB, 5
        write_gpus(gpus_file, gpus)

        def resampled():
            got = parse(scrape(port))
            return value(got, "astrai_gpu_memory_used_bytes", device="cuda:1") == 7 * GIB and got
        samples = lu.wait_for("a new NVML sample on /metrics", resampled, interval=0.3)
        assert value(samples, "astrai_gpu_utilization_ratio", device="cuda:1") == 0.05
        assert d.stop() == 0


def non_loopback_address():
    """An IPv4 address of this machine other than loopback, or None."""
    ip = shutil.which("ip")
    if not ip:
        return None
    out = subprocess.run([ip, "-4", "-o", "addr", "show"], capture_output=True,
                         text=True).stdout
    for addr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out):
        if not addr.startswith("127."):
            return addr
    return None


def write_token(root, token):
    """root/token holding token (mode 0600, as astraid requires): its path."""
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(token + "\n")
    os.chmod(token_file, stat.S_IRUSR | stat.S_IWUSR)
    return token_file


def token_daemon(root, name, listen, token_file):
    """astraid in root/name with --http=listen and --token-file, started."""
    d = du.Daemon(os.path.join(root, name),
                  args=[f"--http={listen}", f"--token-file={token_file}"])
    os.makedirs(d.root)
    return d.start()


def check_token_rule(root):
    addr = non_loopback_address()
    token = "tok-" + os.urandom(8).hex()
    token_file = write_token(root, token)
    # Off loopback without a token file: refused at start, as bad input.
    bind = addr or "0.0.0.0"
    d = du.Daemon(os.path.join(root, "notoken"), args=[f"--http={bind}:{tu.free_port()}"])
    os.makedirs(d.root)
    d.start(wait=False)
    rc = d.proc.wait(30)
    d.log.close()
    assert rc == 2 and "token-file" in d.logs() and "http" in d.logs(), (rc, d.logs())
    # Not a numeric address: bad input; a port in use: a failure to start (exit 1).
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    for i, (spec, code, words) in enumerate([
            ("localhost:9464", 2, ["http", "localhost", "numeric"]),
            ("127.0.0.1:99999", 2, ["http", "port"]),
            (f"127.0.0.1:{taken.getsockname()[1]}", 1, ["http", "cannot listen"])]):
        d = du.Daemon(os.path.join(root, f"bad{i}"), args=[f"--http={spec}"])
        os.makedirs(d.root)
        d.start(wait=False)
        rc = d.proc.wait(30)
        d.log.close()
        assert rc == code and all(w in d.logs() for w in words), (spec, rc, d.logs())
    taken.close()
    # 0.0.0.0 with the token: loopback peers need none.
    port = tu.free_port()
    d = token_daemon(root, "any", f"0.0.0.0:{port}", token_file)
    with du.guarded(d):
        assert http_get(port, "/metrics")[0] == 200
        # A loopback peer naming another host (a page on a name rebound to 127.0.0.1) is
        # trusted no more than a remote one.
        rebound = {"Host": f"rebind.attacker.example:{port}"}
        assert http_get(port, "/metrics", headers=rebound)[0] == 401
        assert http_get(port, "/metrics", headers={
            **rebound, "Authorization": f"Bearer {token}"})[0] == 200
        assert http_get(port, "/metrics", headers={"Host": f"localhost:{port}"})[0] == 200
        if addr:
            for headers in [{}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Bearer {token}x"},
                            {"Authorization": token}]:
                status, _, _ = http_get(port, "/metrics", headers=headers, host=addr)
                assert status == 401, (headers, status)
            for path in ["/api/jobs", "/api/history?job=1", "/no/such/path"]:
                assert http_get(port, path, host=addr)[0] == 401, path
            # The page holds no data: a browser opens it without a header, then sends the
            # token on its /api requests.
            status, headers, _ = http_get(port, "/", host=addr)
            assert status == 200 and headers["Content-Type"].startswith("text/html"), status
            status, _, body = http_get(port, "/metrics", host=addr,
                                       headers={"Authorization": f"Bearer {token}"})
            assert status == 200 and b"astrai_uptime_seconds" in body, status
        else:
            print("no non-loopback address here: the 401 part is skipped")
        assert d.stop() == 0


def restarts_total(port, job):
    return value(parse(scrape(port)), "astrai_job_restarts_total", job_id=job,
                 job_name="restarts")


def check_restarts_monotonic(port, c, model, data):
    """astrai_job_restarts_total is a counter: a job whose rank was killed (restart 1) keeps
    it when resume resets the restarts status shows (its restart budget)."""
    job = c.call("submit", du.spec(model, data, n_epoch=2000, name="restarts"))["job"]
    with du.hold(c, job) as held:
        os.kill(held.job["ranks"][0]["pid"], signal.SIGKILL)
    du.wait_job(c, job, ["queued", "starting", "running"], pred=lambda j: j["restarts"] == 1)
    assert restarts_total(port, job) == 1
    c.call("cancel", {"job": job})
    du.wait_job(c, job, ["cancelled"])
    c.call("resume", {"job": job})
    st = du.wait_job(c, job, ["queued", "starting", "running"])
    assert st["restarts"] == 0, st
    got = restarts_total(port, job)
    assert got == 1, f"astrai_job_restarts_total went from 1 to {got} on resume"
    c.call("cancel", {"job": job})
    du.wait_job(c, job, ["cancelled"])


# A tiny DeepSeekMoE feed-forward (docs/design.md §7a): 4 routed experts, 2 of them per token.
MOE_KEYS = dict(ffn_type="moe", n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
                topk_method="greedy", intermediate_size=32)


def newest_load_extremes(db_path):
    """(step, most, least) of the newest step of progress.db's expert_load table: the most and
    least loaded routed expert of any layer over its layer's mean, computed here."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        step = db.execute("SELECT MAX(step) FROM expert_load").fetchone()[0]
        layers = {}
        for layer, tokens in db.execute(
                "SELECT layer, tokens FROM expert_load WHERE step = ? ORDER BY layer, expert",
                (step,)):
            layers.setdefault(layer, []).append(tokens)
    finally:
        db.close()
    assert step is not None and layers, f"{db_path}: no expert_load rows"
    most = max(max(t) * len(t) / sum(t) for t in layers.values())
    least = min(min(t) * len(t) / sum(t) for t in layers.values())
    return step, most, least


def status_line(d, job):
    out, _ = tu.run([tu.binary("astraictl"), "--socket", d.socket, "status", str(job)])
    return out.splitlines()[0]


def check_experts(root, d, port, c, data, dense):
    """A mixture of experts' job: status, /metrics and `astraictl status` carry the newest
    step's load extremes; the dense job has none of them."""
    model = tu.make_model(os.path.join(root, "moe"), dict(tu.SMALL_CONFIG, **MOE_KEYS))
    job = c.call("submit", du.spec(model, data, name="moe"))["job"]
    st = du.wait_job(c, job, ["completed"])
    step, most, least = newest_load_extremes(du.progress_db(d, job))
    assert step == st["step"] and most > least, (step, most, least, st)
    text = scrape(port)
    check_promtool(text)  # the families with a series
    samples = parse(text)
    keys = ["expert_load_max", "expert_load_min"]
    for key, want in zip(keys, [most, least]):
        assert math.isclose(st[key], want, rel_tol=1e-12), (key, st[key], want)
        got = value(samples, f"astrai_job_{key}", job_id=job, job_name="moe")
        assert got == st[key], (key, got, st[key])
    dense_st = c.call("status", {"job": dense})
    assert all(dense_st.get(k) is None for k in keys), dense_st
    assert not [k for k in samples if k[0].startswith("astrai_job_expert_load") and
                ("job_id", str(dense)) in k[1]], "a dense job has expert load series"
    line = status_line(d, job)
    assert f"expert_load max {most:.2f}x min {least:.2f}x of mean" in line, line
    assert "expert_load" not in status_line(d, dense)
    print(f"moe: step {step} expert load max {most:.4f} min {least:.4f}; status: {line}")


def main():
    missing = [t for t in ("prometheus", "promtool") if not shutil.which(t)]
    if missing:
        print(f"skipped: {' and '.join(missing)} not installed (Debian package prometheus)")
        sys.exit(SKIP)
    root = tu.tmpdir()
    model, data, port, d = http_setup(root)
    with du.guarded(d):
        c = d.client()
        job = c.call("submit", du.spec(model, data, name=NAME, ckpt_interval=3))["job"]
        st = du.wait_job(c, job, ["completed"])
        assert st["loss"] is not None and st["last_checkpoint"], st
        # Progress numbers on /metrics may lag status, but not a finished job's: its run's
        # last ones are read before it shows the state it ended in, and they no longer move.
        text = scrape(port)
        timed("promtool", check_promtool, text)
        timed("series", check_job_series, parse(text), st)
        timed("request counters", check_requests, port, c, job)
        timed("prometheus", check_prometheus, root, port, c.call("status", {"job": job}))
        timed("restarts counter", check_restarts_monotonic, port, c, model, data)
        timed("experts", check_experts, root, d, port, c, data, job)
        c.close()
        assert d.stop() == 0
    timed("gpus", check_gpus, root)
    timed("token rule", check_token_rule, root)
    print("ok")


if __name__ == "__main__":
    main()
