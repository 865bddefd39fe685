"""CURVE keys and the allow-list: only admitted client keys get a byte through."""
from __future__ import annotations

import pytest
import zmq

from capes.common import curve
from capes.common.deployment import KeysConfig


@pytest.fixture
def keys(tmp_path):
    curve.generate(tmp_path / "keys", ["mon", "ctl"])
    return KeysConfig(dir=str(tmp_path / "keys"), client="mon")


@pytest.fixture
def server(keys):
    ctx = zmq.Context()
    auth = curve.start_authenticator(ctx, keys)
    sock = curve.server_socket(ctx, zmq.ROUTER, keys)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, sock, f"tcp://127.0.0.1:{port}", auth
    finally:
        sock.close(0)
        auth.stop()
        ctx.term()


def test_generate_writes_the_documented_layout(keys, tmp_path):
    root = tmp_path / "keys"
    for rel in ("server.key", "server.key_secret", "clients/mon.key", "clients/ctl.key",
                "secret/mon.key_secret", "secret/ctl.key_secret", "control.token"):
        assert (root / rel).is_file(), rel
    assert (root / "server.key_secret").stat().st_mode & 0o077 == 0
    assert (root / "secret/mon.key_secret").stat().st_mode & 0o077 == 0
    assert not list((root / "clients").glob("*secret*"))


def test_generate_keeps_existing_keys(keys, tmp_path):
    root = tmp_path / "keys"
    before = (root / "server.key_secret").read_text(), (root / "control.token").read_text()
    written = curve.generate(root, ["mon", "new"])
    assert [p.name for p in written] == ["new.key", "new.key_secret"]
    assert ((root / "server.key_secret").read_text(), (root / "control.token").read_text()) \
        == before
    curve.generate(root, ["mon"], overwrite=True)
    assert (root / "server.key_secret").read_text() != before[0]


def test_admitted_client_gets_through_named_by_its_key(server, keys):
    ctx, sock, endpoint, auth = server
    client = curve.client_socket(ctx, zmq.DEALER, keys, "ctl")
    try:
        client.connect(endpoint)
        client.send(b"hello")
        assert sock.poll(5000)
        ident, payload = sock.recv_multipart(copy=False)
        assert payload.bytes == b"hello"
        assert payload.get("User-Id") == "ctl"
    finally:
        client.close(0)


def test_unlisted_key_and_plain_peer_are_refused(server, keys, tmp_path):
    ctx, sock, endpoint, auth = server
    other = tmp_path / "other"
    curve.generate(other, ["intruder"])
    # an intruder that knows the server's public key but has no admitted key
    (other / "server.key").write_text((tmp_path / "keys" / "server.key").read_text())
    intruder = curve.client_socket(ctx, zmq.DEALER, str(other), "intruder")
    plain = ctx.socket(zmq.DEALER)
    try:
        intruder.connect(endpoint)
        plain.connect(endpoint)
        intruder.send(b"inject", zmq.NOBLOCK)
        plain.send(b"inject", zmq.NOBLOCK)
        assert not sock.poll(800)
        assert auth.denied >= 1
    finally:
        intruder.close(0)
        plain.close(0)


def test_router_mandatory_reports_unknown_peers(server):
    ctx, sock, endpoint, auth = server
    with pytest.raises(zmq.ZMQError) as info:
        sock.send_multipart([b"nobody", b"x"], zmq.NOBLOCK)
    assert info.value.errno == zmq.EHOSTUNREACH


def test_missing_keys_say_what_to_run(tmp_path):
    ctx = zmq.Context()
    try:
        with pytest.raises(curve.KeysMissing, match="capes keys generate"):
            curve.client_socket(ctx, zmq.DEALER, KeysConfig(dir=str(tmp_path)), "mon")
        with pytest.raises(curve.KeysMissing, match="capes keys generate"):
            curve.start_authenticator(ctx, KeysConfig(dir=str(tmp_path)))
    finally:
        ctx.destroy(0)


def test_disabled_keys_make_plain_sockets(tmp_path):
    ctx = zmq.Context()
    try:
        keys = KeysConfig(dir=str(tmp_path / "none"), enabled=False)
        assert curve.start_authenticator(ctx, keys) is None
        sock = curve.client_socket(ctx, zmq.DEALER, keys)
        assert sock.mechanism == zmq.NULL
        sock.close(0)
    finally:
        ctx.term()
