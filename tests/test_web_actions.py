"""The web page's buttons and GPU panel (web/index.html, daemon/http.c) in a real browser.

astraid --http on a free loopback port, with the stand-in NVML of tests/fake_nvml.c (two GPUs
of known numbers, as tests/test_daemon_gpu.py has them), while a tiny job trains. Debian's
headless Chromium, driven over the DevTools protocol on a pipe (--remote-debugging-pipe: no
WebSocket library needed), opens the page; the test clicks the job's buttons with the mouse
(Input.dispatchMouseEvent at the button's place, once the browser says the button is there)
and checks each verb on the control socket:

- pause -> the job pauses (paused), resume -> it runs again, checkpoint -> a checkpoint past
  the one it had appears (last_checkpoint), cancel -> cancelled; the page shows each outcome
  (#action) and the job's new state in its row;
- the GPU panel shows the fake NVML's name, memory used/total and utilisation per GPU;
- the routes: GET of an action is 405 (Allow: POST), POST of a read route 405, a missing or
  bad ?job= 400, an unknown job 404, a verb in the wrong state 409, an Origin of another site
  403 (and the job unchanged);
- off loopback (astraid --http on this machine's other address, with --token-file): a POST
  from a non-loopback peer without the token, or with a wrong one, is 401 and changes nothing;
  the page opened there without #token= says that actions need the token and shows the 401;
  with #token= its pause button pauses the job. Skipped where the machine has no address but
  loopback.

The page with the GPU panel is kept as ASTRAI_BUILD/artifacts/web_actions.png. Every wait is
for an event (a state on the socket, an element in the page), never a time.
Skipped (exit 77, saying why) where chromium is not installed."""

import base64
import fcntl
import json
import os
import select
import shutil
import socket
import subprocess
import sys

import daemon_util as du
import test_launch_util as lu
import train_util as tu
from test_daemon_gpu import GPUS, write_gpus
from test_daemon_metrics import non_loopback_address, write_token

SKIP = 77
CHROMIUM = "chromium"
TOKEN = "act+ions/tok=="


class Browser:
    """Headless Chromium on a DevTools pipe: it reads commands on its fd 3 and writes replies
    and events on its fd 4, each message JSON ended by a NUL byte."""

    def __init__(self, profile):
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()
        # Above the fds the child's 3 and 4 are made from, so dup2 overwrites neither.
        hi_r = fcntl.fcntl(to_r, fcntl.F_DUPFD_CLOEXEC, 10)
        hi_w = fcntl.fcntl(from_w, fcntl.F_DUPFD_CLOEXEC, 10)

        def pipes_as_3_and_4():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.stderr = open(os.path.join(profile + ".log"), "wb")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1400,1000",
             "about:blank"], stdout=self.stderr, stderr=self.stderr, close_fds=False,
            preexec_fn=pipes_as_3_and_4)
        for fd in (to_r, from_w, hi_r, hi_w):
            os.close(fd)
        self.buf, self.next_id, self.session = b"", 0, None

    def read(self, timeout=60):
        while b"\0" not in self.buf:
            ready, _, _ = select.select([self.from_r], [], [], timeout)
            assert ready, f"chromium sent nothing within {timeout} s"
            chunk = os.read(self.from_r, 1 << 16)
            assert chunk, f"chromium closed its DevTools pipe (exit {self.proc.poll()})"
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=None):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        while True:  # events (no id) are not looked at
            m = self.read()
            if m.get("id") == self.next_id:
                assert "error" not in m, f"{method}: {m['error']}"
                return m["result"]

    def open(self, url):
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]

    def eval(self, expr):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, self.session)
        assert "exceptionDetails" not in r, f"{expr}: {r['exceptionDetails']}"
        return r["result"].get("value")

    def wait(self, what, expr, timeout=60):
        """Until expr (JavaScript) is true in the page; its value."""
        return lu.wait_for(what, lambda: self.eval(expr), timeout, 0.05)

    def text(self, selector):
        return self.eval(f"document.querySelector({json.dumps(selector)})?.textContent ?? null")

    def click(self, selector):
        """A mouse click in the middle of the element, once it is enabled and the topmost
        element there (the browser's own hit test)."""
        where = f"""(() => {{
            const e = document.querySelector({json.dumps(selector)});
            if (!e || e.disabled) return null;
            e.scrollIntoView({{block: "center"}});
            const r = e.getBoundingClientRect(), x = r.x + r.width / 2, y = r.y + r.height / 2;
            return document.elementFromPoint(x, y) === e ? [x, y] : null;
        }})()"""
        x, y = self.wait(f"{selector} enabled", where)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y,
                                                   "button": "left", "clickCount": 1},
                      self.session)

    def screenshot(self, path):
        png = self.send("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(png))

    def close(self):
        try:
            self.send("Browser.close")
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_w)
        os.close(self.from_r)
        self.stderr.close()


def row_state(job):
    return f'tr[data-job="{job}"] td.state'


def button(job, verb):
    return f'button[data-job="{job}"][data-action="{verb}"]'


def click_verb(b, c, job, verb, states, pred=None):
    """Clicks the job's verb button; its state on the socket once in states (and pred); the
    page's message about it."""
    b.click(button(job, verb))
    st = du.wait_job(c, job, states, pred=pred)
    msg = b.wait(f"the page's message after {verb}",
                 f"(t => t.startsWith('job {job}: {verb}') && t)(document.querySelector("
                 f"'#action').textContent)")
    print(f"clicked {verb}: job {job} {st['state']}; page: {msg!r}")
    return st


def check_buttons(b, c, job):
    b.wait("the job running in the page", f"document.querySelector('{row_state(job)}')"
                                           f"?.textContent === 'running'")
    click_verb(b, c, job, "pause", ["paused"])
    b.wait("paused in the page", f"document.querySelector('{row_state(job)}').textContent"
                                 " === 'paused'")
    paused = c.call("status", {"job": job})
    assert paused["last_checkpoint"], f"a pause checkpoints: {paused}"
    click_verb(b, c, job, "resume", ["running"])
    b.wait("running again in the page", f"document.querySelector('{row_state(job)}')"
                                        ".textContent === 'running'")
    before = c.call("status", {"job": job})["last_checkpoint"]
    st = click_verb(b, c, job, "checkpoint", ["running"],
                    pred=lambda j: j["last_checkpoint"] not in (None, before))
    assert os.path.isdir(st["last_checkpoint"]), st["last_checkpoint"]
    print(f"checkpoint: {before} -> {st['last_checkpoint']}")
    click_verb(b, c, job, "cancel", ["cancelled"])
    b.wait("cancelled in the page", f"document.querySelector('{row_state(job)}').textContent"
                                    " === 'cancelled'")
    assert b.eval(f"document.querySelector('{button(job, 'pause')}').disabled"), \
        "pause is enabled on a cancelled job"


def check_gpu_panel(b):
    expr = """JSON.stringify([...document.querySelectorAll('#gpus tbody tr')].map(tr => [
        tr.dataset.gpu, tr.querySelector('td.name').textContent,
        tr.querySelector('td.mem').dataset.used, tr.querySelector('td.mem').dataset.total,
        tr.querySelector('td.mem').textContent, tr.querySelector('td.util').textContent]))"""
    want = [[str(i), name, str(used), str(total),
             f"{used / (1 << 30):.1f} / {total / (1 << 30):.1f} GiB", f"{util}%"]
            for i, (total, used, util, _, name) in enumerate(GPUS)]
    got = b.wait("the GPU panel", f"(t => t !== '[]' && t)({expr})")
    assert json.loads(got) == want, f"GPU panel {got}, fake NVML {want}"
    print(f"GPU panel: {got}")


def http(addr, port, method, path, headers=(), source=None):
    """(status, headers text, body) of one request on a new connection (from source)."""
    s = socket.create_connection((addr, port), timeout=30,
                                 source_address=(source, 0) if source else None)
    head = f"{method} {path} HTTP/1.1\r\nHost: {addr}:{port}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers) + "Content-Length: 0\r\n\r\n"
    s.sendall(head.encode())
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    top, _, body = got.partition(b"\r\n\r\n")
    return int(top.split()[1]), top.decode(), body.decode()


def check_routes(c, port, job):
    """The action routes' methods, parameters and errors, the Origin rule."""
    a = "127.0.0.1"
    status, top, _ = http(a, port, "GET", f"/api/pause?job={job}")
    assert status == 405 and "\r\nAllow: POST" in top, top
    status, top, _ = http(a, port, "POST", "/api/jobs")
    assert status == 405 and "\r\nAllow: GET, HEAD" in top, top
    for path, want, text in [("/api/pause", 400, "job: missing"),
                             ("/api/pause?job=x1", 400, "job: expected an integer"),
                             ("/api/pause?job=9999", 404, "no such job: 9999")]:
        status, _, body = http(a, port, "POST", path)
        assert status == want and text in json.loads(body)["error"], (path, status, body)
    status, _, body = http(a, port, "POST", f"/api/checkpoint?job={job}")  # cancelled
    assert status == 409 and "cannot checkpoint" in json.loads(body)["error"], (status, body)
    st = c.call("status", {"job": job})["state"]
    status, _, body = http(a, port, "POST", f"/api/resume?job={job}",
                           [("Origin", "http://evil.example")])
    assert status == 403 and c.call("status", {"job": job})["state"] == st, (status, body)
    print("routes: 405 both ways, 400, 404, 409, cross-origin 403")


def check_off_loopback(root, model, data):
    addr = non_loopback_address()
    if not addr:
        print("no non-loopback address here: the token part is skipped")
        return
    port = tu.free_port()
    d = du.Daemon(os.path.join(root, "remote"),
                  args=[f"--http={addr}:{port}", f"--token-file={write_token(root, TOKEN)}"])
    os.makedirs(d.root)
    d.start()
    with du.guarded(d):
        c = d.client()
        job = c.call("submit", du.spec(model, data, n_epoch=2000, name="remote"))["job"]
        du.running(c, job)
        for headers in ([], [("Authorization", "Bearer wrong")]):
            status, _, body = http(addr, port, "POST", f"/api/pause?job={job}", headers,
                                   source=addr)
            assert status == 401 and "unauthorized" in body, (headers, status, body)
        assert c.call("status", {"job": job})["state"] == "running", "a refused pause paused"
        b = Browser(os.path.join(root, "chromium-remote"))
        try:
            b.open(f"http://{addr}:{port}/")
            note = b.wait("the page's note that actions need the token",
                          "(t => t.includes('need the token') && t)("
                          "document.querySelector('#action')?.textContent ?? '')")
            err = b.wait("the 401 of /api/jobs",
                         "(t => t.includes('401') && t)("
                         "document.querySelector('#error')?.textContent ?? '')")
            print(f"off loopback without the token: {note!r}; {err!r}")
            b.open(f"http://{addr}:{port}/#token={TOKEN}")
            b.wait("the job running in the page", f"document.querySelector('{row_state(job)}')"
                                                   f"?.textContent === 'running'")
            click_verb(b, c, job, "pause", ["paused"])
        finally:
            b.close()
        c.call("cancel", {"job": job})
        c.close()
        assert d.stop() == 0


def main():
    if not shutil.which(CHROMIUM):
        print(f"skipped: {CHROMIUM} is not installed (Debian package chromium)")
        return SKIP
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    gpus_file = os.path.join(root, "gpus.txt")
    write_gpus(gpus_file, GPUS)
    port = tu.free_port()
    env = {"LD_LIBRARY_PATH": os.path.join(os.environ["ASTRAI_BUILD"], "fake_nvml"),
           "FAKE_NVML_FILE": gpus_file}
    d = du.Daemon(root, args=[f"--http=127.0.0.1:{port}"], env=env).start()
    with du.guarded(d):
        c = d.client()
        job = c.call("submit", du.spec(model, data, n_epoch=2000, name="buttons"))["job"]
        du.running(c, job)
        b = Browser(os.path.join(root, "chromium"))
        try:
            b.open(f"http://127.0.0.1:{port}/")
            check_gpu_panel(b)
            artifacts = os.path.join(os.environ["ASTRAI_BUILD"], "artifacts")
            os.makedirs(artifacts, exist_ok=True)
            b.screenshot(os.path.join(artifacts, "web_actions.png"))
            check_buttons(b, c, job)
        finally:
            b.close()
        check_routes(c, port, job)
        c.close()
        check_off_loopback(root, model, data)
    assert d.stop() == 0
    shutil.rmtree(root, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
