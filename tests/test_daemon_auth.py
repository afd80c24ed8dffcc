"""Who may act on a job (docs/protocol.md "Who may act"):
- with --token-file, every state-changing request needs the token, loopback included: a loopback
  HTTP POST /api/cancel without it is 401 and the job runs on; with the bearer token, or with the
  HttpOnly SameSite=Strict cookie POST /login sets, the action is taken; read-only GETs on
  loopback stay open; a TCP verb before auth is -32003 and changes nothing;
- on the Unix socket, pause/resume/checkpoint/cancel/rm of a job another uid submitted is
  -32006 (forbidden) naming the rule, unless the caller is root or in --admin-group; a user acts
  on their own jobs. Other users are real uids (setpriv), one of them a member of a group the
  test makes (groupadd/useradd, removed at the end)."""

import json
import os
import subprocess
import sys

import daemon_util as du
import train_util as tu
from test_daemon_metrics import write_token
from test_web_actions import http

TOKEN = "s3cr3t-t0ken+/="
OTHER_UID = 54321  # a uid with no account: it owns only what it submits
CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
s.connect(sys.argv[1])
s.sendall((json.dumps({"jsonrpc": "2.0", "id": 1, "method": sys.argv[2],
                       "params": json.loads(sys.argv[3])}) + "\n").encode())
buf = b""
while not buf.endswith(b"\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
print(buf.decode().strip())
"""


def as_uid(uid, gid, socket_path, method, params):
    """The reply of one request sent by a process of uid (setpriv: no supplementary groups)."""
    p = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                        sys.executable, "-c", CLIENT, socket_path, method, json.dumps(params)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def must_be_forbidden(reply, job, uid, verb):
    err = reply.get("error") or {}
    assert err.get("code") == -32006, reply
    for needle in (f"job {job} was submitted by uid 0", f"uid {uid} may not {verb}"):
        assert needle in err["message"], reply
    print(f"uid {uid} {verb} job {job}: {err['message']}")


def make_admin(tag):
    group, user = f"astrai-ops-{tag}", f"astrai-adm-{tag}"
    subprocess.run(["groupadd", group], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", group,
                    user], check=True)
    ids = subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True)
    gid = subprocess.run(["id", "-g", user], capture_output=True, text=True, check=True)
    return group, user, int(ids.stdout), int(gid.stdout)


def main():
    if os.geteuid() != 0:
        print("not root: other uids cannot be made here; skipped")
        sys.exit(77)
    tag = str(os.getpid())
    group, user, admin_uid, admin_gid = make_admin(tag)
    root = tu.tmpdir()
    os.chmod(root, 0o755)  # the other uids reach the socket in it
    model, data = du.make_setup(root)
    tcp_port, http_port = tu.free_port(), tu.free_port()
    d = du.Daemon(root, args=[f"--token-file={write_token(root, TOKEN)}",
                              f"--tcp=127.0.0.1:{tcp_port}", f"--http=127.0.0.1:{http_port}",
                              f"--admin-group={group}"])
    try:
        d.start()
        with du.guarded(d):
            os.chmod(d.socket, 0o666)  # who may connect is the socket's mode: here anyone
            c = d.client()
            long_job = dict(n_epoch=100000)
            job = c.call("submit", du.spec(model, data, **long_job))["job"]
            du.running(c, job)
            # another uid: every verb refused, the job untouched
            for verb in ("pause", "checkpoint", "cancel", "rm"):
                must_be_forbidden(as_uid(OTHER_UID, OTHER_UID, d.socket, verb, {"job": job}),
                                  job, OTHER_UID, verb)
            assert c.call("status", {"job": job})["state"] == "running"
            # a user acts on their own job
            theirs = as_uid(OTHER_UID, OTHER_UID, d.socket, "submit",
                            du.spec(model, data, **long_job))["result"]["job"]
            assert c.call("status", {"job": theirs})["submitted_by"] == OTHER_UID
            reply = as_uid(OTHER_UID, OTHER_UID, d.socket, "cancel", {"job": theirs})
            assert reply["result"]["state"] == "cancelled", reply
            # TCP on loopback: nothing before auth
            t = du.Client(tcp=("127.0.0.1", tcp_port))
            du.expect_error(lambda: t.call("cancel", {"job": job}), -32003, "unauthorized")
            t.close()
            assert c.call("status", {"job": job})["state"] == "running"
            # HTTP on loopback: reads open, actions need the token
            status, _, _ = http("127.0.0.1", http_port, "GET", "/api/jobs")
            assert status == 200, status
            status, _, body = http("127.0.0.1", http_port, "POST", f"/api/pause?job={job}")
            assert status == 401 and "needs the token" in body, (status, body)
            status, _, _ = http("127.0.0.1", http_port, "POST", "/login",
                                [("Authorization", "Bearer wrong")])
            assert status == 401, status
            assert c.call("status", {"job": job})["state"] == "running"
            status, head, _ = http("127.0.0.1", http_port, "POST", "/login",
                                   [("Authorization", f"Bearer {TOKEN}")])
            assert status == 204, status
            cookie = [line.split(":", 1)[1].strip() for line in head.split("\r\n")
                      if line.lower().startswith("set-cookie:")]
            assert cookie and "HttpOnly" in cookie[0] and "SameSite=Strict" in cookie[0], head
            print(f"login cookie: {cookie[0]}")
            login = cookie[0].split(";")[0]
            status, _, body = http("127.0.0.1", http_port, "POST", f"/api/pause?job={job}",
                                   [("Cookie", login)])
            assert status == 200, (status, body)
            du.wait_job(c, job, ["paused"])
            status, _, body = http("127.0.0.1", http_port, "POST", f"/api/resume?job={job}",
                                   [("Authorization", f"Bearer {TOKEN}")])
            assert status == 200, (status, body)
            du.running(c, job)
            # a member of --admin-group may act on anyone's job
            reply = as_uid(admin_uid, admin_gid, d.socket, "cancel", {"job": job})
            assert reply["result"]["state"] in ("cancelled", "running"), reply
            du.wait_job(c, job, ["cancelled"])
            # root acts on anyone's
            other = as_uid(OTHER_UID, OTHER_UID, d.socket, "submit",
                           du.spec(model, data, **long_job))["result"]["job"]
            assert c.call("cancel", {"job": other})["state"] == "cancelled"
            c.close()
            assert d.stop() == 0
    finally:
        subprocess.run(["userdel", user])
        subprocess.run(["groupdel", group])
    print("ok")


if __name__ == "__main__":
    main()
