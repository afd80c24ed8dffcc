"""astraid's web page (web/index.html) in a real browser. astraid --http on a free loopback
port while a tiny job trains; Debian's headless Chromium loads http://127.0.0.1:PORT/ twice,
the job training on in between, and dumps the DOM once the page's polls ran
(--virtual-time-budget):

- the job's row shows its name (as text: it holds markup), state, step and total, loss;
- its loss and lr curves are drawn, one point per step of its history: at least the row's
  step, at most the rows of its progress.db (no point read twice, none lost);
- the second load shows a later step and more points (the page follows the training);
- #updated holds the time of the last poll, #error is empty;
- off loopback, #token= with a base64 token ("+", "/", "=") is sent as written: the jobs
  show, no 401.

The second load's screenshot is kept: ASTRAI_BUILD/artifacts/web_page.png. Also: / serves
web/index.html byte for byte as text/html, and the page references nothing outside the
daemon (no external src/href/url(), no absolute URL but the SVG namespace). Skipped (exit 77,
saying why) where chromium is not installed."""

import html.parser
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import urllib.parse
import urllib.request

import daemon_util as du
import test_launch_util as lu
import train_util as tu
from test_daemon_http import http_get
from test_daemon_metrics import non_loopback_address, token_daemon, write_token

SKIP = 77
CHROMIUM = "chromium"
# Virtual time the page runs before its DOM is dumped: a few of its 1 s polls. Virtual time
# stands still while a request is pending, so the polls complete however slow the machine.
BUDGET_MS = 4000
JOB_NAME = "web <b>page</b> & co"
SVG_NS = "http://www.w3.org/2000/svg"


class Dom(html.parser.HTMLParser):
    """What the page shows: rows[job] = {cell class: text, "tags": tags inside the row},
    curves[(job, metric)] = data-points of its path, updated/error = those elements."""

    def __init__(self, text):
        super().__init__()
        self.rows, self.curves, self.ids = {}, {}, {}
        self.row = self.cell = self.svg = self.capture = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-job" in a:
            self.row = self.rows.setdefault(a["data-job"], {"tags": []})
        elif self.row is not None:
            self.row["tags"].append(tag)
            if tag == "td":
                self.cell, self.row[a.get("class")] = a.get("class"), ""
        if tag == "svg" and "curve" in a.get("class", "").split():
            self.svg = (a.get("data-job"), a.get("data-metric"))
        elif tag == "path" and self.svg and "data-points" in a:
            self.curves[self.svg] = int(a["data-points"])
        if a.get("id") in ("updated", "error"):
            self.capture = a["id"]
            self.ids[self.capture] = {"text": "", **a}

    def handle_endtag(self, tag):
        if tag == "tr":
            self.row = None
        elif tag == "td":
            self.cell = None
        elif tag == "svg":
            self.svg = None
        elif tag in ("time", "div") and self.capture:
            self.capture = None

    def handle_data(self, data):
        if self.row is not None and self.cell:
            self.row[self.cell] += data
        if self.capture:
            self.ids[self.capture]["text"] += data


def chromium(url, profile, screenshot=None):
    """The DOM Chromium shows for url after BUDGET_MS of the page's time (and a screenshot)."""
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={profile}", f"--virtual-time-budget={BUDGET_MS}",
            "--window-size=1280,1000", "--hide-scrollbars"]
    if screenshot:
        args.append(f"--screenshot={screenshot}")
    proc = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "<table" in proc.stdout, (
        f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return Dom(proc.stdout)


def check_served_page(base):
    with urllib.request.urlopen(base + "/", timeout=10) as r:
        assert r.status == 200, r.status
        ctype = r.headers["Content-Type"]
        served = r.read()
    assert ctype.startswith("text/html"), ctype
    with open(os.path.join(os.environ["ASTRAI_SRC"], "web", "index.html"), "rb") as f:
        assert served == f.read(), "/ is not web/index.html as it is in the tree"
    page = served.decode()
    # Every reference the page makes (attributes, CSS url(), @import) stays on the daemon.
    refs = re.findall(r"""\b(?:src|href|action|xlink:href)\s*=\s*["']?([^"'\s>]+)""", page)
    refs += re.findall(r"""url\(\s*["']?([^"')]+)""", page)
    refs += re.findall(r"""@import\s+["']?([^"';\s]+)""", page)
    external = [x for x in refs if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", x)]
    assert not external, f"the page references {external}"
    urls = set(re.findall(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>)]*", page))
    assert urls <= {SVG_NS}, f"the page holds absolute URLs {urls - {SVG_NS}}"
    assert not re.search(r"""["'(]\s*//[^/\s]""", page), "a protocol-relative URL"


def progress_rows(d, job):
    db = sqlite3.connect(os.path.join(d.state_dir, "jobs", str(job), "progress.db"), timeout=5)
    n = db.execute("SELECT count(*) FROM steps WHERE loss IS NOT NULL").fetchone()[0]
    db.close()
    return n


def api_step(port, job):
    """The job's step in /api/jobs."""
    jobs = json.loads(http_get(port, "/api/jobs")[2])["jobs"]
    return next(j["step"] for j in jobs if j["id"] == job)


def check_load(dom, d, job, status):
    """The page's view of the job; returns (its step, its loss curve's points)."""
    row = dom.rows.get(str(job))
    assert row, f"no row for job {job}: rows {list(dom.rows)}"
    assert row["name"] == JOB_NAME and "b" not in row["tags"], \
        f"the name is not shown as text: {row}"
    assert row["state"] == "running", row
    m = re.fullmatch(r"(\d+) / (\d+)", row["step"])
    assert m and int(m[2]) == status["total_steps"], row
    step = int(m[1])
    assert step > 0 and float(row["loss"]) > 0, row
    loss, lr = dom.curves.get((str(job), "loss")), dom.curves.get((str(job), "lr"))
    assert loss is not None and lr is not None, f"curves {dom.curves}"
    rows = progress_rows(d, job)
    # The history is read after the jobs list, from the database the row's step lags.
    assert step <= loss <= rows and lr == loss, \
        f"job at step {step}: {loss} loss / {lr} lr points drawn, {rows} rows in progress.db"
    upd, err = dom.ids["updated"], dom.ids["error"]
    assert upd.get("datetime") and upd["text"].startswith("updated"), upd
    assert err["text"] == "", f"the page shows an error: {err['text']}"
    return step, loss


TOKEN = "ab+cd/ef=="  # base64: "+" must reach the daemon as "+", not as a space


def check_token(root, model, data):
    """Off loopback, the page sends #token= as written (percent-decoded only): a base64
    token with "+" and "/" gets the jobs, as does its percent-encoded form; a wrong one
    shows HTTP 401. Skipped where this machine has no address but loopback."""
    addr = non_loopback_address()
    if not addr:
        print("no non-loopback address here: the token part is skipped")
        return
    port = tu.free_port()
    d = token_daemon(root, "remote", f"{addr}:{port}", write_token(root, TOKEN))
    with du.guarded(d):
        c = d.client()
        job = c.call("submit", du.spec(model, data, name="tok"))["job"]
        c.call("cancel", {"job": job})
        c.close()
        for i, fragment in enumerate([TOKEN, urllib.parse.quote(TOKEN, safe=""),
                                      f"{TOKEN}&job={job}"]):
            dom = chromium(f"http://{addr}:{port}/#token={fragment}",
                           os.path.join(root, f"chromium-token{i}"))
            err = dom.ids["error"]["text"]
            assert err == "" and str(job) in dom.rows, \
                f"#token={fragment}: error {err!r}, rows {list(dom.rows)}"
        dom = chromium(f"http://{addr}:{port}/#token=ab%20cd/ef==",
                       os.path.join(root, "chromium-wrong"))
        assert "401" in dom.ids["error"]["text"], dom.ids["error"]
        assert d.stop() == 0


def main():
    if not shutil.which(CHROMIUM):
        print(f"skipped: {CHROMIUM} is not installed (Debian package chromium)")
        return SKIP
    root = tu.tmpdir()
    model, data = du.make_setup(root)
    port = tu.free_port()
    base = f"http://127.0.0.1:{port}"
    d = du.Daemon(root, args=[f"--http=127.0.0.1:{port}"]).start()
    artifact = os.path.join(os.environ["ASTRAI_BUILD"], "artifacts", "web_page.png")
    os.makedirs(os.path.dirname(artifact), exist_ok=True)
    if os.path.exists(artifact):
        os.remove(artifact)
    with du.guarded(d):
        check_token(root, model, data)
        check_served_page(base)
        c = d.client()
        # Cancelled at the end of the test; its ranks held while the page loads, so that it
        # runs all through the test, however fast the machine.
        job = c.call("submit", du.spec(model, data, n_epoch=2000, name=JOB_NAME))["job"]
        with du.hold(c, job, pred=lambda j: j["step"] >= 3) as held:
            status = held.job
            step1, points1 = check_load(chromium(base + "/", os.path.join(root, "chromium1")),
                                        d, job, status)
        # Until /api/jobs (whose steps may lag status's) shows a step past every point the
        # first load drew: the second load shows a later step and more points.
        lu.wait_for(f"/api/jobs at a step past {points1}",
                    lambda: api_step(port, job) > points1)
        with du.hold(c, job):
            dom2 = chromium(base + "/", os.path.join(root, "chromium2"), screenshot=artifact)
            step2, points2 = check_load(dom2, d, job, status)
        assert step2 > step1 and points2 > points1, \
            f"the page did not follow the job: step {step1} -> {step2}, points " \
            f"{points1} -> {points2}"
        with open(artifact, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{artifact} is not a PNG"
        print(f"job {job}: step {step1} -> {step2}, loss curve {points1} -> {points2} points; "
              f"screenshot {artifact}")
        c.call("cancel", {"job": job})
        du.wait_job(c, job, ["cancelled"])
        c.close()
    assert d.stop() == 0
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
