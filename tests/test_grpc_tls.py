"""TLS on the gRPC control plane (issue 12, item 9): ``capes keys generate`` makes a
self-signed certificate; a daemon listening beyond loopback speaks TLS with it, and
refuses to start without one unless ``daemon.allow_insecure_grpc = true``; clients pin
the certificate. Real daemon processes on 0.0.0.0."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time

import grpc
import pytest

from capes.common import curve
from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import load_deployment
from daemon_harness import ROOT, DaemonProcess, write_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="capes keys generate makes the certificate with openssl")


@pytest.fixture
def deployment(tmp_path):
    curve.generate(tmp_path / "keys", ["mon"])
    return tmp_path


def test_keys_generate_makes_a_certificate_and_a_private_key_0600(deployment):
    keys = deployment / "keys"
    cert, key = keys / curve.TLS_CERT, keys / curve.TLS_KEY
    assert b"BEGIN CERTIFICATE" in cert.read_bytes()
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(key.parent).st_mode) == 0o700
    assert curve.generate(keys, ["mon"]) == []                 # kept, not remade
    out = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-text"],
                         capture_output=True, text=True)
    assert f"DNS:{curve.TLS_NAME}" in out.stdout


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True), ("127.8.0.1:1", True),
    ("unix:/tmp/x", True), ("0.0.0.0:1", False), ("[::]:1", False), ("10.0.0.5:1", False),
    ("capes.example.org:1", False)])
def test_is_loopback(address, loopback):
    assert curve.is_loopback(address) is loopback


def _daemon_fails(config, *sets) -> str:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "capes", "interface-daemon", "--config",
                          str(config), *sets], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0 and time.monotonic() - t0 < 10, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def test_a_non_loopback_bind_without_tls_is_refused_unless_allowed(deployment):
    shutil.rmtree(deployment / "keys" / "tls")
    cfg = write_config(deployment, grpc="0.0.0.0:0")
    line = _daemon_fails(cfg)
    assert "without TLS" in line and "allow_insecure_grpc" in line, line

    cfg = write_config(deployment, grpc="0.0.0.0:0", extra="allow_insecure_grpc = true")
    d = DaemonProcess(cfg, deployment / "ready.json")
    try:
        port = d.info["grpc"].rsplit(":", 1)[1]
        with ControlClient(f"127.0.0.1:{port}", curve.load_token(
                load_deployment(cfg).keys)) as c:
            assert c.status()["nodes"] == 0                # plaintext, as asked
    finally:
        d.stop()
    assert "clear text" in d.log.read_text()


def test_beyond_loopback_the_control_plane_speaks_tls_with_the_pinned_certificate(
        deployment):
    cfg = write_config(deployment, grpc="0.0.0.0:0")
    d = DaemonProcess(cfg, deployment / "ready.json")
    try:
        deploy = load_deployment(cfg)
        address = d.info["grpc"]                            # 0.0.0.0:PORT: not loopback
        with ControlClient.from_config(deploy, address, timeout=5) as c:
            assert c.status()["nodes"] == 0                 # over TLS
            assert c.health() == "SERVING"
        port = address.rsplit(":", 1)[1]
        with ControlClient(f"127.0.0.1:{port}", curve.load_token(deploy.keys),
                           timeout=2) as plain:
            with pytest.raises(ControlError, match="UNAVAILABLE"):
                plain.status()                              # plaintext is not spoken
        # a certificate other than the daemon's is not trusted
        other = deployment / "other"
        curve.generate(other, [])
        with ControlClient(address, curve.load_token(deploy.keys), timeout=2,
                           tls_cert=(other / curve.TLS_CERT).read_bytes()) as wrong:
            with pytest.raises(ControlError, match="UNAVAILABLE"):
                wrong.status()
    finally:
        d.stop()
    assert "clear text" not in d.log.read_text()


def test_loopback_stays_plaintext(deployment):
    d = DaemonProcess(write_config(deployment), deployment / "ready.json")
    try:
        channel = grpc.insecure_channel(d.info["grpc"])
        grpc.channel_ready_future(channel).result(timeout=5)
        channel.close()
    finally:
        d.stop()


def _status(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capes", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_status_and_the_other_commands_load_the_certificate_beyond_loopback(deployment):
    """``capes status|nodes|tuning --grpc ADDR``: the config's certificate, or
    --tls-cert, for an address beyond loopback (or a loopback address of a daemon that
    listens beyond it); with none, one clear line."""
    cfg = write_config(deployment, grpc="0.0.0.0:0")
    d = DaemonProcess(cfg, deployment / "ready.json")
    try:
        port = d.info["grpc"].rsplit(":", 1)[1]
        beyond, local = f"0.0.0.0:{port}", f"127.0.0.1:{port}"
        no_engine = ["--engine-metrics", ""]
        for addr in (beyond, local):          # the daemon speaks TLS on every interface
            out = _status("status", "--config", str(cfg), "--grpc", addr, *no_engine)
            assert out.returncode == 0 and "nodes 0" in out.stdout, out.stderr
        # an operator's machine: the token, but no certificate in its keys dir
        ws = deployment / "workstation"
        (ws / "keys").mkdir(parents=True)
        shutil.copy(deployment / "keys" / curve.TOKEN_FILE, ws / "keys")
        ws_cfg = write_config(ws)                       # its own daemon.grpc: loopback
        out = _status("status", "--config", str(ws_cfg), "--grpc", beyond, *no_engine)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and "Traceback" not in out.stderr
        assert "tls/server.crt" in lines[0] and "--tls-cert" in lines[0], lines
        cert = str(deployment / "keys" / curve.TLS_CERT)
        out = _status("status", "--config", str(ws_cfg), "--grpc", beyond, "--tls-cert", cert,
                      *no_engine)
        assert out.returncode == 0 and "nodes 0" in out.stdout, out.stderr
        for cmd in (["nodes"], ["tuning", "off"], ["workload-changed"]):
            out = _status(*cmd, "--config", str(ws_cfg), "--grpc", beyond, "--tls-cert", cert)
            assert out.returncode == 0, (cmd, out.stderr)
        out = _status("nodes", "--config", str(ws_cfg), "--grpc", beyond, "--tls-cert",
                      str(ws / "nope.crt"))
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1
        assert "nope.crt" in out.stderr
        # a demo's work dir: the certificate beside its token
        (ws / "capes-demo.json").write_text(
            '{"grpc": "%s", "token_file": "%s"}' % (beyond, deployment / "keys" /
                                                    curve.TOKEN_FILE))
        out = _status("status", "--workdir", str(ws), *no_engine)
        assert "nodes 0" in out.stdout, out.stderr
        with ControlClient.from_config(load_deployment(cfg), beyond) as c:
            assert c.status()["tuning"] is False        # `capes tuning off` got through
    finally:
        d.stop()
