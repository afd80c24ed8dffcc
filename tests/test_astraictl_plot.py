"""The `history` method and `astraictl plot` through a real astraid and real training runs:
- history returns exactly the rows of the job's progress.db (read here with sqlite3), val_loss
  at the validation steps only, null for a missing or infinite value; since_step/limit paging
  gives the same rows, a page stays under 512 KiB; bad params and unknown jobs are errors
  naming them; replies stay in order behind a history read, and a client leaving while one
  is read does not disturb the daemon;
- a job whose rank is killed (-9) mid-run and restarted from its checkpoint is one curve:
  steps 1..total_steps once each, the losses of a job never killed; the plot's title shows
  its restarts, and `plot --follow` (started before the kill) returns once it completed;
- `plot --svg F` is XML with one path point per step, and the C renderer's SVGs of every
  case (test_plot --svg-dir) parse as XML, U+FFFD in place of the characters XML 1.0 forbids;
- piped output has no escape codes and fits $COLUMNS; on a terminal (a pty) --follow redraws
  in place with braille; --follow on a finished job returns after one chart."""

import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import sqlite3
import struct
import subprocess
import termios
import time
import xml.etree.ElementTree as ET

import daemon_util as du
import train_util as tu

SVG = "{http://www.w3.org/2000/svg}"
KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "wall_time")


def progress_rows(d, jid):
    """The job's curve as progress.db holds it, in the shape history returns."""
    path = os.path.join(d.state_dir, "jobs", str(jid), "progress.db")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    rows = db.execute("SELECT s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s, s.wall_time,"
                      " v.step, v.val_loss FROM steps s LEFT JOIN validation v"
                      " ON v.step = s.step ORDER BY s.step").fetchall()
    db.close()
    out = []
    for r in rows:
        row = {"step": r[0], **dict(zip(KEYS, r[1:6]))}
        if r[6] is not None:
            row["val_loss"] = r[7]
        out.append(row)
    return out


def history_all(c, jid, limit=None):
    """Every page of history (since_step paging); checks each page's bound and "more"."""
    rows, since = [], 0
    while True:
        params = {"job": jid, "since_step": since}
        if limit:
            params["limit"] = limit
        page = c.call("history", params)
        assert not limit or len(page["steps"]) <= limit, (limit, len(page["steps"]))
        rows += page["steps"]
        if not page["more"]:
            return rows
        assert page["steps"], "more with an empty page"
        since = page["steps"][-1]["step"]


def ctl(d, *args, env=None, timeout=60):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", *args],
                          capture_output=True, text=True, env=e, timeout=timeout)


def check_history(d, c, model, data):
    jid = c.call("submit", du.spec(model, data, n_epoch=2, val_split=0.2, val_step=5,
                                   name="tiny"))["job"]
    done = du.wait_job(c, jid, ["completed"])
    db = progress_rows(d, jid)
    assert len(db) == done["total_steps"] > 20, (len(db), done["total_steps"])
    assert any("val_loss" in r for r in db) and not all("val_loss" in r for r in db), db
    assert history_all(c, jid) == db, "history differs from progress.db"
    assert history_all(c, jid, limit=7) == db, "pages of 7 differ from progress.db"
    page = c.call("history", {"job": jid, "since_step": 10, "limit": 5})
    assert [r["step"] for r in page["steps"]] == [11, 12, 13, 14, 15] and page["more"], page
    last = db[-1]["step"]
    page = c.call("history", {"job": jid, "since_step": last - 2, "limit": 2})
    assert [r["step"] for r in page["steps"]] == [last - 1, last] and not page["more"], page
    assert c.call("history", {"job": jid, "since_step": last}) == {"steps": [], "more": False}

    du.expect_error(lambda: c.call("history", {"job": 999}), -32001, "no such job: 999")
    du.expect_error(lambda: c.call("history", {}), -32602, "job")
    for key, bad in (("limit", 0), ("limit", 10001), ("limit", 2.5), ("since_step", -1),
                     ("since_step", "3")):
        du.expect_error(lambda: c.call("history", {"job": jid, key: bad}), -32602, key)

    # Pipelined: the reply to daemon.info waits for the history read before it.
    c.send_raw((f'{{"jsonrpc":"2.0","id":101,"method":"history","params":{{"job":{jid}}}}}\n'
                '{"jsonrpc":"2.0","id":102,"method":"daemon.info"}\n').encode())
    first, second = c.reply(), c.reply()
    assert (first["id"], second["id"]) == (101, 102), (first, second)
    assert len(first["result"]["steps"]) == len(db)
    # A client that leaves before its history is read.
    for _ in range(20):
        gone = d.client()
        gone.send_raw(f'{{"jsonrpc":"2.0","id":1,"method":"history","params":{{"job":{jid}}}}}\n'
                      .encode())
        gone.close()
    assert c.call("daemon.info")["pid"] == d.proc.pid
    return jid, done, db


def check_plot_outputs(d, jid, done, db):
    # Piped: no escape code, every line within $COLUMNS, the title and the axis labels.
    p = ctl(d, "plot", str(jid), env={"COLUMNS": "50", "LC_ALL": "C.UTF-8"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "\x1b" not in p.stdout and max(len(line) for line in lines) <= 50, p.stdout
    assert lines[0].startswith(f"job {jid} tiny | loss ") and "completed" in lines[0], lines[0]
    assert re.search("[\u2801-\u28ff]", p.stdout), "no braille dot in an UTF-8 locale"
    assert lines[-1].split()[0] == "1" and lines[-1].split()[-1] == str(db[-1]["step"]), lines
    # ASCII in the C locale; --metric val_loss has the validation steps alone.
    p = ctl(d, "plot", str(jid), "--metric", "val_loss", "--width", "60", env={"LC_ALL": "C"})
    assert p.returncode == 0 and p.stdout.isascii() and "| val_loss " in p.stdout, p
    val_steps = [r["step"] for r in db if "val_loss" in r]
    assert p.stdout.splitlines()[-1].split()[-1] == str(val_steps[-1]), p.stdout
    # --follow on a finished job: one chart, then it returns.
    t0 = time.time()
    p = ctl(d, "plot", str(jid), "--follow", "--height", "8", timeout=20)
    assert p.returncode == 0 and p.stdout.count(f"job {jid} ") == 1, p
    assert len(p.stdout.splitlines()) == 8 and time.time() - t0 < 10, p.stdout
    # --json: every history row, one object (cJSON prints 15 digits when they read back
    # within an epsilon: numbers to 1e-14).
    p = ctl(d, "--json", "plot", str(jid))
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["job"] == jid and len(out["steps"]) == len(db), p
    for got, want in zip(out["steps"], db):
        assert got.keys() == want.keys() and all(
            math.isclose(got[k], want[k], rel_tol=1e-14) for k in want), (got, want)
    # --svg: the XML's path has one point per step.
    svg = os.path.join(d.root, "loss.svg")
    p = ctl(d, "plot", str(jid), "--svg", svg)
    assert p.returncode == 0 and svg in p.stdout, p
    root = ET.parse(svg).getroot()
    assert root.tag == SVG + "svg" and f"job {jid} tiny" in root.find(SVG + "title").text
    curve = [e for e in root.iter(SVG + "path") if e.get("class") == "curve"]
    assert len(curve) == 1 and len(re.findall("[ML]", curve[0].get("d"))) == len(db), curve
    assert not [f for f in os.listdir(d.root) if ".tmp." in f], "a temporary file stayed"
    # Errors: a bad metric or size is bad usage, an unknown job the daemon's error.
    for args in (["--metric", "accuracy"], ["--width", "5"], ["--height", "2"], ["--rank", "1"]):
        p = ctl(d, "plot", str(jid), *args)
        assert p.returncode == 2 and args[0] in p.stderr, (args, p.returncode, p.stderr)
    p = ctl(d, "plot", "999")
    assert p.returncode == 1 and "no such job: 999" in p.stderr, p


def check_page_bytes(d, c, jid, db):
    """A page stops before 512 KiB of rows (replies are lines of at most 1 MiB): 10000 more
    rows written into the finished job's progress.db come in several pages, every one once."""
    last = db[-1]["step"]
    path = os.path.join(d.state_dir, "jobs", str(jid), "progress.db")
    con = sqlite3.connect(path, timeout=5)
    con.executemany("INSERT INTO steps VALUES(?,?,?,?,?,?,?,?)",
                    [(last + i, 9, 0, 1 / 3 + i, 1 / 7, 1 / 9, 12345.678901234567, 1.7e9 + i / 3)
                     for i in range(1, 10001)])
    # No loss, an infinite one (astrai-train records neither; another writer might): null.
    con.executemany("INSERT INTO steps VALUES(?,9,0,?,0.1,0.2,3.0,1.8e9)",
                    [(last + 10001, None), (last + 10002, float("inf"))])
    con.commit()
    con.close()
    page = c.call("history", {"job": jid, "since_step": last, "limit": 10000})
    size = len(json.dumps(page, separators=(",", ":")))
    assert page["more"] and 0 < len(page["steps"]) < 10000 and size < 512 * 1024, \
        (page["more"], len(page["steps"]), size)
    rows = history_all(c, jid, limit=10000)
    assert [r["step"] for r in rows] == list(range(1, last + 10003))
    assert rows[-3]["loss"] == 1 / 3 + 10000 and rows[-3]["wall_time"] == 1.7e9 + 10000 / 3
    assert rows[-2]["loss"] is None and rows[-1]["loss"] is None and rows[-1]["lr"] == 0.1
    p = ctl(d, "plot", str(jid), "--width", "100")
    assert p.returncode == 0 and "| loss 1e+04 |" in p.stdout.splitlines()[0], p


def check_restarts(d, c, model, data):
    """One curve through a kill -9 of rank 0 and the restart from its checkpoint."""
    kw = dict(n_epoch=8, ckpt_interval=20, max_restarts=3)
    ref = c.call("submit", du.spec(model, data, **kw))["job"]
    du.wait_job(c, ref, ["completed"])
    jid = c.call("submit", du.spec(model, data, name="killed", **kw))["job"]
    follow = subprocess.Popen([tu.binary("astraictl"), f"--socket={d.socket}", "plot", str(jid),
                               "--follow", "--width", "80"], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, LC_ALL="C"))
    with du.hold(c, jid) as held:  # killed at step 30, however fast the machine
        held.advance(du.progress_db(d, jid), to=30)
        du.checkpoint_past(c, d, jid, held)
        os.kill(held.pids[0], signal.SIGKILL)
    done = du.wait_job(c, jid, ["completed"], timeout=120)
    assert done["restarts"] == 1, done
    rows = history_all(c, jid, limit=50)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, done["total_steps"] + 1)), steps
    assert [r["loss"] for r in rows] == [r["loss"] for r in history_all(c, ref)], \
        "the restarted job's curve differs from the one never killed"
    out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0, follow.returncode
    titles = [line for line in out.splitlines() if line.startswith(f"job {jid} ")]
    assert len(titles) >= 2 and "completed" in titles[-1] and "restarts 1" in titles[-1], titles
    p = ctl(d, "plot", str(jid), env={"LC_ALL": "C"})
    assert "| restarts 1" in p.stdout.splitlines()[0], p.stdout


def check_tty(d, c, model, data):
    """On a terminal --follow redraws in place (cursor up, clear) with braille, sized to it."""
    jid = c.call("submit", du.spec(model, data, n_epoch=6))["job"]
    # Held until astraictl drew its first chart: the job trains on after that (redraws),
    # however fast the machine.
    held = du.hold(c, jid)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 64, 0, 0))
    proc = subprocess.Popen([tu.binary("astraictl"), f"--socket={d.socket}", "plot", str(jid),
                             "--follow"], stdout=slave, stderr=slave,
                            env=dict(os.environ, LC_ALL="C.UTF-8"))
    os.close(slave)
    out = b""
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: astraictl exited, its side of the pty closed
                break
            if not chunk:
                break
            out += chunk
            held.release()
    finally:
        held.release()
    os.close(master)
    assert proc.wait(10) == 0
    text = out.decode()
    assert re.search("[\u2801-\u28ff]", text), text
    # Each redraw goes up the lines of the chart before it (the first may be "no steps yet").
    redraws = [int(n) for n in re.findall(r"\x1b\[(\d+)A\r\x1b\[J", text)]
    charts = re.split(r"\x1b\[\d+A\r\x1b\[J", text)
    assert redraws and [c.count("\n") for c in charts[:-1]] == redraws, (redraws, text[-2000:])
    assert charts[-1].count("\n") == 20 and "completed" in charts[-1].splitlines()[0], charts[-1]
    for line in charts[-1].replace("\r", "").splitlines():
        assert len(line) <= 64, line


def check_renderer_svgs(root):
    out = os.path.join(root, "svgs")
    os.makedirs(out)
    tu.run([tu.binary("test_plot"), "--svg-dir", out])
    names = sorted(os.listdir(out))
    assert {"empty.svg", "one.svg", "gaps.svg", "constant.svg", "negative.svg",
            "bad_chars.svg"} <= set(names)
    for name in names:
        svg = ET.parse(os.path.join(out, name)).getroot()
        assert svg.tag == SVG + "svg" and "<&>" in svg.find(SVG + "title").text, name
    # U+FFFE, U+FFFF, a control, a tab, a surrogate, an overlong form, a byte not UTF-8
    title = ET.parse(os.path.join(out, "bad_chars.svg")).getroot().find(SVG + "title").text
    assert title == "job 9 <&> a\ufffd b\ufffd c\ufffd d\ufffd e\ufffd f\ufffd\ufffd\ufffd " \
                    "g\ufffd\ufffd h\U0001f600 \u20ac", repr(title)


def main():
    root = tu.tmpdir()
    check_renderer_svgs(root)
    model, data = du.make_setup(root)
    d = du.Daemon(root, max_restarts=3).start()
    with du.guarded(d):
        c = d.client()
        jid, done, db = check_history(d, c, model, data)
        check_plot_outputs(d, jid, done, db)
        check_page_bytes(d, c, jid, db)
        check_restarts(d, c, model, data)
        check_tty(d, c, model, data)
        c.close()
        assert d.stop() == 0
    print("ok")


if __name__ == "__main__":
    main()
