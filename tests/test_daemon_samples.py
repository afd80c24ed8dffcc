"""Samples during training through astraid: a job with sample_interval 2 over 5 steps,
submitted with `astraictl submit --wait` (it returns on the job's final progress push), on a
model whose tokenizer renders a {"messages"} prompt, a {"prompt"} line holding `<b>&`:

- submit refuses a sample_prompts or chat_template that is missing or relative, and the
  inconsistent pair, naming the key;
- the `samples` method: the newest step's rows by default (the end, step 5), `step` selects one,
  `all` pages through every step (since_step); each row is progress.db's; an unknown job is
  -32001, bad params -32602 naming them;
- `astraictl samples JOB` prints "step 5, sample 1:" then "PROMPT → COMPLETION" with the texts'
  line breaks, `--step 2` that step's, `--all` every step's, `--json` the rows as sent;
- /api/samples holds the same rows, and the web page (headless Chromium, the job selected with
  #job=ID) shows them below the job's curves as text: the `<b>` of the prompt is no tag there.
  That part is skipped (said so) where chromium is not installed.
- pages: rows past 128 KiB of text are paged by whole steps (since_step), astraictl --all
  follows them.
"""
import html.parser
import json
import os
import shutil
import sqlite3
import subprocess

import daemon_util as du
import test_astrai_generate as ag
import train_util as tu
from test_daemon_http import http_get

CONFIG = dict(tu.SMALL_CONFIG, max_position_embeddings=64)
WINDOW = 16
PROMPTS = [{"prompt": "x <b>&"},
           {"messages": [{"role": "user", "content": "say hi"}]}]


def setup(root):
    model = tu.make_model(root, CONFIG)
    ag.write_tokenizer(model, chars=ag.CHARS + "&", size=256)
    data, _ = tu.make_text_data(root, 10 * WINDOW + 1)  # 10 windows: 5 steps of 2
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in PROMPTS)
    spec = {"train_type": "seq", "param_path": model, "data_root_path": data,
            "window_size": WINDOW, "batch_per_device": 2, "max_lr": 2e-3, "min_rate": 1,
            "threads": 1, "name": "samples", "ckpt_dir": os.path.join(root, "ckpt"),
            "sample_interval": 2, "sample_prompts": prompts, "sample_max_tokens": 8}
    job_file = os.path.join(root, "job.json")
    with open(job_file, "w") as f:  # relative: astraictl makes it absolute from its directory
        json.dump(dict(spec, sample_prompts="prompts.jsonl"), f)
    return job_file, spec


def ctl(d, *args, cwd=None):
    p = subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", *args],
                       capture_output=True, text=True, timeout=120, cwd=cwd)
    assert p.returncode == 0, f"astraictl {args}: exit {p.returncode}\n{p.stderr}"
    return p.stdout


def db_rows(d, job):
    """progress.db's samples as the method's rows, in (step, index) order."""
    db = sqlite3.connect(du.progress_db(d, job))
    rows = [{"step": s, "index": i, "prompt": p, "completion": c, "tokens": t}
            for s, i, p, c, t in db.execute("SELECT step, idx, prompt, completion, tokens FROM "
                                            "samples ORDER BY step, idx")]
    db.close()
    return rows


def printed(rows):
    """astraictl samples' text of rows."""
    return "\n".join(f"step {r['step']}, sample {r['index'] + 1}:\n{r['prompt']} \u2192 "
                     f"{r['completion']}\n" for r in rows)


def check_method(c, job, rows):
    at = {s: [r for r in rows if r["step"] == s] for s in (2, 4, 5)}
    assert sorted({r["step"] for r in rows}) == [2, 4, 5] and all(len(v) == 2 for v in at.values()), \
        f"progress.db samples {rows}"
    assert c.call("samples", {"job": job}) == {"job": job, "samples": at[5], "more": False}
    assert c.call("samples", {"job": job, "step": 2})["samples"] == at[2]
    assert c.call("samples", {"job": job, "step": 3})["samples"] == []
    assert c.call("samples", {"job": job, "all": True})["samples"] == rows
    assert c.call("samples", {"job": job, "all": True, "since_step": 2})["samples"] == \
        at[4] + at[5]
    du.expect_error(lambda: c.call("samples", {"job": 999}), -32001, "no such job: 999")
    du.expect_error(lambda: c.call("samples", {"job": "1"}), -32602, "job")
    du.expect_error(lambda: c.call("samples", {"job": job, "step": -1}), -32602, "step")
    du.expect_error(lambda: c.call("samples", {"job": job, "all": 1}), -32602, "all")
    du.expect_error(lambda: c.call("samples", {"job": job, "all": True, "step": 2}), -32602,
                    "step", "all")
    print(f"ok: samples method: newest (step 5), step 2, all, since_step; errors")
    return at


def check_astraictl(d, job, rows, at):
    out = ctl(d, "samples", str(job))
    assert out == printed(at[5]), f"astraictl samples:\n{out}\nwant:\n{printed(at[5])}"
    assert "x <b>&" in out and "<user>say hi\n<assistant>" in out, out
    assert ctl(d, "samples", str(job), "--step", "2") == printed(at[2])
    assert ctl(d, "samples", str(job), "--all") == printed(rows)
    got = json.loads(ctl(d, "--json", "samples", str(job), "--all"))
    assert got == {"job": job, "samples": rows}, got
    assert ctl(d, "samples", str(job), "--step", "3") == f"job {job}: no samples at step 3\n"
    p = subprocess.run([tu.binary("astraictl"), f"--socket={d.socket}", "samples", "999"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no such job: 999" in p.stderr, (p.returncode, p.stderr)
    print(f"ok: astraictl samples:\n{out}")


class Samples(html.parser.HTMLParser):
    """The pre.sample elements of one job's section: [{"prompt", "completion", "tags"}]."""

    def __init__(self, job, text):
        super().__init__()
        self.job, self.section, self.rows, self.span, self.depth = str(job), False, [], None, 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.section = a.get("data-job") == self.job
        elif self.section and tag == "pre" and a.get("class") == "sample":
            self.rows.append({"prompt": "", "completion": "", "tags": [], "step": a["data-step"]})
        elif self.section and self.rows and tag == "span":
            self.span = a.get("class")
        elif self.section and self.rows:
            self.rows[-1]["tags"].append(tag)

    def handle_endtag(self, tag):
        if tag == "span":
            self.span = None
        if tag == "section":
            self.section = False

    def handle_data(self, data):
        if self.section and self.rows and self.span in ("prompt", "completion"):
            self.rows[-1][self.span] += data


def check_web(root, port, job, newest):
    api = json.loads(http_get(port, f"/api/samples?job={job}")[2])
    assert api == {"samples": newest, "more": False}, api
    assert json.loads(http_get(port, f"/api/samples?job={job}&step=2")[2])["samples"][0]["step"] == 2
    assert http_get(port, "/api/samples?job=999")[0] == 404
    assert http_get(port, f"/api/samples?job={job}&step=x")[0] == 400
    if not shutil.which("chromium"):
        print("skipped: the web page part (chromium is not installed)")
        return
    p = subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
                        f"--user-data-dir={os.path.join(root, 'chromium')}",
                        "--virtual-time-budget=4000", "--dump-dom",
                        f"http://127.0.0.1:{port}/#job={job}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    shown = Samples(job, p.stdout).rows
    want = [{"prompt": r["prompt"], "completion": r["completion"], "tags": [],
             "step": str(r["step"])} for r in newest]
    assert shown == want, f"the page shows {shown}, want {want}"
    assert "x &lt;b&gt;&amp;" in p.stdout, "the prompt is not escaped in the page's HTML"
    assert "samples at step 5" in p.stdout
    print("ok: the web page shows step 5's samples as text")


def check_pages(d, c, job):
    """Rows past a page's 128 KiB: steps 100-102 of two 40 KiB completions each, added to the
    finished job's progress.db. `all` pages end on whole steps (the one cut is left to the next
    page) and together are every row; astraictl --all follows them."""
    db = sqlite3.connect(du.progress_db(d, job))
    db.executemany("INSERT INTO samples VALUES(?, ?, 'p', ?, 1, 0)",
                   [(s, i, f"{s}:{i}:" + "y" * 40960) for s in (100, 101, 102) for i in (0, 1)])
    db.commit()
    db.close()
    rows, pages, since = db_rows(d, job), [], 0
    while True:
        page = c.call("samples", {"job": job, "all": True, "since_step": since})
        pages.append(sorted({r["step"] for r in page["samples"]}))
        if not page["more"]:
            break
        since = page["samples"][-1]["step"]
        assert page["samples"] == [r for r in rows if pages[-1][0] <= r["step"] <= since], \
            f"page {len(pages)} is not whole steps: {pages[-1]}"
    assert pages == [[2, 4, 5, 100], [101], [102]], pages
    got = json.loads(ctl(d, "--json", "samples", str(job), "--all"))["samples"]
    assert got == rows, "astraictl samples --all lost rows across pages"
    page = c.call("samples", {"job": job})
    assert [r["step"] for r in page["samples"]] == [102] * 2 and not page["more"], page["more"]
    print(f"ok: samples pages {pages}")


def check_submit_refusals(c, spec):
    """astraid checks the samples' files at submit, naming the key; no job is queued."""
    missing = spec["sample_prompts"] + ".missing"
    du.expect_error(lambda: c.call("submit", dict(spec, sample_prompts=missing)), -32602,
                    "sample_prompts", missing)
    du.expect_error(lambda: c.call("submit", dict(spec, sample_prompts="prompts.jsonl")),
                    -32602, "sample_prompts", "relative path")
    du.expect_error(lambda: c.call("submit", dict(spec, chat_template=missing)), -32602,
                    "chat_template", missing)
    du.expect_error(lambda: c.call("submit", dict(spec, sample_interval=0)), -32602,
                    "sample_prompts", "sample_interval")
    assert c.call("list")["jobs"] == [], "a refused submit queued a job"
    print("ok: submit refuses a missing or relative sample_prompts, a missing chat_template, "
          "the inconsistent pair")


def main():
    root = tu.tmpdir()
    job_file, spec = setup(root)
    port = tu.free_port()
    d = du.Daemon(root, args=[f"--http=127.0.0.1:{port}"]).start()
    with du.guarded(d):
        c = d.client()
        check_submit_refusals(c, spec)
        out = ctl(d, "submit", job_file, "--wait", cwd=root)
        job = int(out.split()[1])
        assert out.strip().endswith("completed"), out
        rows = db_rows(d, job)
        at = check_method(c, job, rows)
        check_astraictl(d, job, rows, at)
        check_web(root, port, job, at[5])
        check_pages(d, c, job)
        c.close()
    assert d.stop() == 0
    shutil.rmtree(root, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
