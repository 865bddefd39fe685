"""CURVE keys and sockets: every CAPES ZeroMQ socket is authenticated and encrypted.

Key directory (made by ``capes keys generate --dir DIR --client NAME ...``)::

    DIR/server.key            the daemon's public key (every client needs it)
    DIR/server.key_secret     the daemon's secret key (daemon only, mode 0600)
    DIR/clients/NAME.key      allow-list: public keys of admitted clients
    DIR/clients/NAME.nodes    the node names key NAME may speak for, one a line (``*``:
                              any node no other key is bound to)
    DIR/secret/NAME.key_secret  a client's secret key (copy to that client only, 0600)
    DIR/control.token         shared secret of the gRPC control plane (0600)
    DIR/tls/server.crt        the control plane's TLS certificate (self-signed, name
                              ``capes-daemon``): clients pin it (copy it to them)
    DIR/tls/server.key        its private key (daemon only, 0600)

The daemon runs a ZAP authenticator (``zmq.auth.ThreadAuthenticator``) that admits a
client only if its public key is in ``DIR/clients``; a peer without an admitted key never
completes the handshake, so none of its bytes reach the daemon's code. The authenticator
reports the key's file name (``NAME``) as the ZMQ ``User-Id`` of every message, which the
daemon uses to pin a node name to the key that first spoke for it, and to refuse node
names outside the key's binding.

Bindings (:meth:`AllowList.may_speak_for`): ``capes keys generate --client n1`` binds key
``n1`` to node ``n1`` (``--bind NAME=NODE,...`` names other nodes). A key bound to nodes
speaks for those only; a node bound to some key is refused to every key not bound to
it. A key with ``*`` (``--any-node NAME``: a key shared on purpose) or with no
``NAME.nodes`` file at all (key directories made before bindings were the default) may
speak for any node that no key is bound to; the daemon names such keys at startup.

With ``KeysConfig.enabled = false`` sockets are plain: only for protocol tests on a
trusted loopback.
"""
from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"
TOKEN_FILE = "control.token"
TLS_CERT, TLS_KEY = "tls/server.crt", "tls/server.key"
TLS_NAME = "capes-daemon"            # the certificate's name; clients verify against it


class KeysMissing(RuntimeError):
    """Keys are missing or unreadable (the message says which file and what to run)."""


def _dir(keys) -> Path:
    """A keys directory from a KeysConfig, a str or a Path."""
    return Path(getattr(keys, "dir", keys))


def _enabled(keys) -> bool:
    return bool(getattr(keys, "enabled", True)) and keys is not None


def generate(keys_dir: str | Path, clients: list[str], overwrite: bool = False,
             bind_to_name: bool = False) -> list[Path]:
    """Create the server key pair (unless present), one key pair per client and the
    control-plane token; return the files written. Existing keys are kept unless
    ``overwrite``, so adding a client never invalidates the others. ``bind_to_name``:
    each client key made now is bound to the node of its own name (``capes keys
    generate`` does this). Secret files are created 0600 (the secret directory 0700):
    there is no moment a secret is readable by others, whatever the umask."""
    root = Path(keys_dir)
    allow, secret = root / "clients", root / "secret"
    for d in (root, allow):
        d.mkdir(parents=True, exist_ok=True)
    secret.mkdir(mode=0o700, exist_ok=True)
    os.chmod(secret, 0o700)             # tighten a directory made wider by hand or by umask
    written: list[Path] = []
    if overwrite or not (root / f"{SERVER}.key_secret").exists():
        written += _key_pair(root / f"{SERVER}.key", root / f"{SERVER}.key_secret")
    for name in clients:
        if not name or "/" in name or name.startswith(".") or name == SERVER:
            raise ValueError(f"bad client name {name!r}")
        if not overwrite and (secret / f"{name}.key_secret").exists():
            continue
        written += _key_pair(allow / f"{name}.key", secret / f"{name}.key_secret")
        if bind_to_name:
            written.append(bind(root, name, [name]))
    token = root / TOKEN_FILE
    if overwrite or not token.exists():
        _write_new(token, secrets.token_hex(32) + "\n", 0o600)
        written.append(token)
    written += generate_tls(root, overwrite)
    return written


def generate_tls(keys_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """The control plane's TLS key and self-signed certificate (EC P-256, 10 years,
    name ``capes-daemon``), made with the ``openssl`` command; [] when they exist (and
    not ``overwrite``) or when ``openssl`` is not installed (then a non-loopback gRPC
    address needs ``daemon.allow_insecure_grpc``)."""
    import shutil
    import subprocess
    import tempfile
    root = Path(keys_dir)
    cert, key = root / TLS_CERT, root / TLS_KEY
    if not overwrite and cert.exists() and key.exists():
        return []
    openssl = shutil.which("openssl")
    if openssl is None:
        return []
    cert.parent.mkdir(mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:          # 0700: the key is never exposed
        k, c = Path(tmp) / "k.pem", Path(tmp) / "c.pem"
        out = subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650", "-keyout", str(k),
             "-out", str(c), "-subj", f"/CN={TLS_NAME}",
             "-addext", f"subjectAltName=DNS:{TLS_NAME}"],
            capture_output=True, text=True)
        if out.returncode != 0:
            raise OSError(f"openssl could not make the TLS certificate: "
                          f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        _write_new(key, k.read_text(), 0o600)
        _write_new(cert, c.read_text(), 0o644)
    return [cert, key]


def tls_files(keys) -> tuple[bytes, bytes] | None:
    """(certificate, private key) of the control plane, None when there are none (or
    keys are disabled). The key is absent on clients: then (certificate, b"")."""
    if keys is None or not _enabled(keys):
        return None
    root = _dir(keys)
    try:
        cert = (root / TLS_CERT).read_bytes()
    except FileNotFoundError:
        return None
    try:
        key = (root / TLS_KEY).read_bytes()
    except FileNotFoundError:
        key = b""
    return cert, key


def is_loopback(address: str) -> bool:
    """Whether a gRPC ``host:port`` address stays on this machine: an IP literal of the
    loopback range (127.0.0.0/8, ::1), exactly ``localhost``, or a unix socket. A name
    is never guessed from its look (``127.attacker.example`` resolves anywhere), and
    ``0.0.0.0`` and ``[::]`` listen on every interface."""
    import ipaddress
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        host = address                      # no port: the whole text is the host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_BANNER = ("#   ****  Generated on {} by CAPES (capes keys generate)  ****\n"
           "#   ZeroMQ CURVE {} Certificate\n\n")


def _key_pair(public_path: Path, secret_path: Path) -> list[Path]:
    """Write a new key pair in ZeroMQ's certificate format (readable by
    ``zmq.auth.load_certificate``): the public file 0644, the secret file 0600."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    now = datetime.datetime.now()
    body = f'metadata\ncurve\n    public-key = "{public}"\n'
    _write_new(public_path, _BANNER.format(now, "Public") + body, 0o644)
    _write_new(secret_path, _BANNER.format(now, "**Secret**") + body +
                   f'    secret-key = "{secret}"\n', 0o600)
    return [public_path, secret_path]


def _write_new(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` through a new file created with ``mode`` (never
    wider), then rename it over ``path``: no window with other permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


ANY_NODE = "*"                       # a binding file line: a key shared on purpose


def bind(keys_dir: str | Path, client: str, nodes: list[str]) -> Path:
    """Bind client key ``client`` to ``nodes``: the daemon then refuses any other node
    name from that key, and these nodes to any other key. ``[ANY_NODE]``: the key is
    shared on purpose (any node no key is bound to). Return the binding file written."""
    root = Path(keys_dir)
    if not (root / "clients" / f"{client}.key").exists():
        raise ValueError(f"--bind {client}: no client key {client!r} in {root / 'clients'}")
    if nodes == [ANY_NODE]:
        path = root / "clients" / f"{client}.nodes"
        _write_new(path, ANY_NODE + "\n", 0o644)
        return path
    bad = [n for n in nodes if not n or n != n.strip() or "\n" in n or len(n.encode()) > 255
           or n == ANY_NODE]
    if bad or not nodes:
        raise ValueError(f"--bind {client}: bad node name {bad[0] if bad else ''!r}")
    path = root / "clients" / f"{client}.nodes"
    _write_new(path, "".join(f"{n}\n" for n in sorted(set(nodes))), 0o644)
    return path


def read_bindings(clients_dir: Path) -> dict[str, frozenset[str]]:
    """{client key name: node names it may speak for} from ``DIR/clients/*.nodes``."""
    out = {}
    for path in sorted(clients_dir.glob("*.nodes")):
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysMissing(f"{path}: unreadable node binding ({exc})") from None
        out[path.stem] = frozenset(line.strip() for line in lines if line.strip())
    return out


def _load(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise KeysMissing(f"{path}: no such key file (make keys with `capes keys generate`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysMissing(f"{path}: not a CURVE key file ({exc})") from None
    if want_secret and not secret:
        raise KeysMissing(f"{path}: has no secret key")
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise KeysMissing(f"{path}: not a CURVE key file (keys must be 40 Z85 characters)")
    return public, secret


def client_keyfile(keys_dir: str | Path, name: str) -> Path:
    """Where client ``name``'s secret key lives (``secret/NAME.key_secret``, or
    ``NAME.key_secret`` directly in the directory when copied to a node)."""
    root = Path(keys_dir)
    for path in (root / "secret" / f"{name}.key_secret", root / f"{name}.key_secret"):
        if path.exists():
            return path
    return root / "secret" / f"{name}.key_secret"


class AllowList(ThreadAuthenticator):
    """The daemon's ZAP handler: admits the client keys in ``DIR/clients/*.key`` and
    names each admitted peer by its key file (the ``User-Id`` of its messages)."""

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path):
        super().__init__(ctx)
        self.clients_dir = _dir(keys_dir) / "clients"
        self.names: dict[bytes, str] = {}
        self.bindings: dict[str, frozenset[str]] = {}   # key -> its nodes (ANY_NODE: shared)
        self.bound_nodes: frozenset[str] = frozenset()  # nodes some key is bound to
        self.denied = 0

    def reload(self) -> int:
        """Re-read the allow-list (after keys were added or removed); return its size."""
        if not self.clients_dir.is_dir():
            raise KeysMissing(f"{self.clients_dir}: no allow-list directory (run `capes "
                              f"keys generate --dir {self.clients_dir.parent}`)")
        names = {}
        for path in sorted(self.clients_dir.glob("*.key")):
            public, _ = _load(path, want_secret=False)
            names[zmq.utils.z85.decode(public)] = path.stem
        bindings = read_bindings(self.clients_dir)
        self.names, self.bindings = names, bindings
        self.bound_nodes = frozenset().union(*bindings.values()) - {ANY_NODE}
        self.configure_curve(domain="*", location=str(self.clients_dir))
        return len(names)

    def unbound(self) -> list[str]:
        """Admitted keys with no binding file (made before bindings were the default):
        they may speak for any node no key is bound to."""
        return sorted(set(self.names.values()) - set(self.bindings))

    def may_speak_for(self, key: str | None, node: str) -> bool:
        """Whether client key ``key`` may use node name ``node``: a key bound to nodes
        speaks for those only; a node bound to keys is theirs alone; a shared or
        unbound key speaks for any other node."""
        bound = self.bindings.get(key or "")
        if bound is not None and ANY_NODE not in bound:
            return node in bound
        return node not in self.bound_nodes

    def bound_to(self, key: str | None, node: str) -> bool:
        """Whether key ``key`` is bound to ``node`` by name (not merely allowed to use
        it): the node is then a real one, vouched for by the key directory."""
        return node in self.bindings.get(key or "", ()) and node != ANY_NODE

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(client_public_key, "?")

    async def _authenticate_curve(self, domain, client_key):
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            self.denied += 1
        return allowed, reason


def start_authenticator(ctx: zmq.Context, keys) -> AllowList | None:
    """Start the allow-list authenticator for ``ctx`` (None when keys are disabled).
    Call ``.stop()`` on it before terminating the context."""
    if not _enabled(keys):
        return None
    auth = AllowList(ctx, _dir(keys))
    auth.start()
    try:
        auth.reload()
    except Exception:
        auth.stop()
        raise
    return auth


def server_socket(ctx: zmq.Context, kind: int, keys, hwm: int = 10_000) -> zmq.Socket:
    """A socket acting as CURVE server with the daemon's key (plain when ``keys`` is
    None or disabled). ROUTER sockets get ROUTER_MANDATORY, so a send to a peer that
    is gone raises ``zmq.ZMQError(EHOSTUNREACH)`` instead of vanishing silently."""
    sock = ctx.socket(kind)
    try:
        _common(sock, hwm)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if _enabled(keys):
            public, secret = _load(_dir(keys) / f"{SERVER}.key_secret", want_secret=True)
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_server = True
    except BaseException:
        sock.close(linger=0)        # an open socket would block the context's term()
        raise
    return sock


def client_socket(ctx: zmq.Context, kind: int, keys, name: str | None = None,
                  hwm: int = 10_000) -> zmq.Socket:
    """A socket acting as CURVE client with key ``name`` (default: ``keys.client``),
    trusting only the daemon's public key ``server.key``."""
    sock = ctx.socket(kind)
    try:
        _common(sock, hwm)
        if _enabled(keys):
            name = name or getattr(keys, "client", None) or "agent"
            root = _dir(keys)
            server_public, _ = _load(root / f"{SERVER}.key", want_secret=False)
            public, secret = _load(client_keyfile(root, name), want_secret=True)
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_serverkey = server_public
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _common(sock: zmq.Socket, hwm: int) -> None:
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    sock.linger = 0
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)


def load_token(keys) -> str | None:
    """The control-plane token (None when keys are disabled or no token file exists)."""
    if not _enabled(keys):
        return None
    path = _dir(keys) / TOKEN_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
