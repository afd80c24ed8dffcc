"""Bad input is answered with the right error and astraid keeps serving: malformed JSON, bad
UTF-8, a 2 MiB line, an unknown method, every class of invalid job spec, an unknown job id,
pause of a completed job, TCP without or with a wrong token, a client that disconnects
mid-reply, a client that stops reading, too many connections; a token file readable by others
is refused at startup."""

import os
import socket
import subprocess
import time

import daemon_util as du
import train_util as tu


def check_framing(d):
    c = d.client()
    c.send_raw(b'{"jsonrpc":"2.0","id":1,"method":\n')
    m = c.read_message()
    assert m["error"]["code"] == -32700 and m["id"] is None, m
    c.send_raw(b'{"jsonrpc":"2.0","id":2,"method":"status","params":{"job":"\xff\xfe"}}\n')
    m = c.read_message()
    assert m["error"]["code"] == -32700, m
    c.send_raw(b"x" * (2 << 20) + b"\n")
    m = c.read_message()
    assert m["error"]["code"] == -32005, m
    assert "version" in c.call("daemon.info")  # the same connection still works
    du.expect_error(lambda: c.call("frobnicate"), -32601, "frobnicate")
    du.expect_error(lambda: c.call("status", [1]), -32602)
    c.send_raw(b'{"jsonrpc":"2.0","method":"list"}\n')  # a notification: no reply
    assert c.call("list")["jobs"] is not None
    c.send_raw(b'[1,2]\n')
    assert c.reply()["error"]["code"] == -32600
    c.close()


def check_specs(d, model, data):
    c = d.client()
    good = du.spec(model, data)
    cases = [
        ({"max_lrr": 1}, "max_lrr", "max_lr"),                      # unknown key, nearest one
        ({"max_lr": "fast"}, "max_lr"),                            # wrong type
        ({"batch_per_device": 0}, "batch_per_device"),             # out of range
        ({"train_type": "rlhf"}, "train_type"),                    # not one of the choices
        ({"priority": "high"}, "priority"),                        # a job key of the wrong type
        ({"devices": 4, "parallel_mode": "ddp"}, "devices"),                               # more than astraid has
        ({"devices": [7]}, "devices"),                             # a device astraid lacks
        ({"nprocs": 2, "devices": 1, "parallel_mode": "ddp"}, "devices"),                  # disagreeing counts
        ({"param_path": "relative/model"}, "param_path"),          # ranks need absolute paths
    ]
    for extra, *names in cases:
        s = dict(good, **extra)
        du.expect_error(lambda: c.call("submit", s), -32602, *names)
    missing = {k: v for k, v in good.items() if k != "data_root_path"}
    du.expect_error(lambda: c.call("submit", missing), -32602, "data_root_path")
    du.expect_error(lambda: c.call("submit", {}), -32602)
    assert c.call("list")["jobs"] == [], "an invalid spec created a job"
    c.close()


def check_jobs(d, model, data):
    c = d.client()
    du.expect_error(lambda: c.call("status", {"job": 999}), -32001, "999")
    du.expect_error(lambda: c.call("cancel", {"job": 999}), -32001, "999")
    du.expect_error(lambda: c.call("status", {"job": "one"}), -32602, "job")
    jid = c.call("submit", du.spec(model, data))["job"]
    du.wait_job(c, jid, ["completed"])
    e = du.expect_error(lambda: c.call("pause", {"job": jid}), -32002, "completed")
    assert e.data == {"state": "completed"}, e.data
    du.expect_error(lambda: c.call("cancel", {"job": jid}), -32002, "completed")
    du.expect_error(lambda: c.call("checkpoint", {"job": jid}), -32002, "completed")
    du.expect_error(lambda: c.call("list", {"state": "sleeping"}), -32602, "state")
    c.close()


def wait_idle(d, timeout=30):
    """Until astraid has closed every connection but the prober's."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        c = d.client()
        try:
            if c.call("daemon.info")["connections"] == 1:
                return
        except du.RpcError as e:
            assert e.code == -32004, e
        finally:
            c.close()
        time.sleep(0.05)
    raise AssertionError("astraid kept the connections of clients that left")


def check_vanishing_clients(d):
    # Many requests, then gone before the replies are read.
    for _ in range(20):
        c = d.client()
        c.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"list"}\n' * 500)
        c.close()
    wait_idle(d)
    # A client that never reads is dropped; others are served meanwhile.
    slow = d.client()
    slow.sock.settimeout(20)
    other = d.client()
    req = b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n' * 2000
    dropped, sent = False, 0
    t0 = time.time()
    while time.time() - t0 < 60:
        try:
            slow.send_raw(req)
            sent += len(req)
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
            break
        except socket.timeout:
            break
        assert "version" in other.call("daemon.info")
    assert dropped, f"a client that does not read was not dropped after {sent} bytes"
    assert "version" in other.call("daemon.info")
    other.close()


def check_connection_limit(d):
    wait_idle(d)
    held = [d.client() for _ in range(16)]  # the limit
    held[0].call("daemon.info")
    extra = d.client()
    m = extra.read_message()
    assert m["error"]["code"] == -32004, m
    for c in held:
        c.close()
    wait_idle(d)  # astraid saw them go
    c = d.client()
    assert "version" in c.call("daemon.info")
    c.close()


def check_tcp(port, token):
    c = du.Client(tcp=("127.0.0.1", port))
    du.expect_error(lambda: c.call("list"), -32003, "auth")
    c = du.Client(tcp=("127.0.0.1", port))
    du.expect_error(lambda: c.call("auth", {"token": token + "x"}), -32003)
    try:
        c.call("list")
        raise AssertionError("the connection stayed open after a wrong token")
    except (ConnectionError, OSError):
        pass
    c = du.Client(tcp=("127.0.0.1", port))
    assert c.call("auth", {"token": token}) == {"ok": True}
    assert c.call("list")["jobs"] is not None
    c.close()


def check_token_mode(root, token_file):
    os.chmod(token_file, 0o644)
    d = du.Daemon(os.path.join(root, "other"), args=[f"--tcp=127.0.0.1:{tu.free_port()}",
                                                     f"--token-file={token_file}"])
    os.makedirs(d.root, exist_ok=True)
    proc = subprocess.run(d.args, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "0644" in proc.stderr and token_file in proc.stderr, proc.stderr


def main():
    root = tu.tmpdir()
    model, data = du.make_setup(root, n_windows=16)
    token = "s3cret-token"
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(token + "\n")
    os.chmod(token_file, 0o600)
    port = tu.free_port()
    d = du.Daemon(root, args=[f"--tcp=127.0.0.1:{port}", f"--token-file={token_file}",
                              "--max-connections=16"]).start()
    with du.guarded(d):
        check_framing(d)
        check_specs(d, model, data)
        check_jobs(d, model, data)
        check_vanishing_clients(d)
        check_connection_limit(d)
        check_tcp(port, token)
        assert d.stop() == 0
    check_token_mode(root, token_file)
    print("ok")


if __name__ == "__main__":
    main()
