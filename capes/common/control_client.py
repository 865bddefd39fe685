"""A small client of the interface daemon's gRPC control plane.

Used by the ``capes status | tuning | training | workload-changed | nodes`` commands and
by the DRL engine daemon (``status()`` for the flags and workload epoch,
``submit_action()`` for its decisions). Results are plain dicts, so callers need no
protobuf. Never imported by the agents.
"""
from __future__ import annotations

from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from capes.common import control_plane_pb2 as pb
from capes.common import control_plane_pb2_grpc as pb_grpc
from capes.common.config import ConfigError

TOKEN_HEADER = "x-capes-token"


class ControlError(RuntimeError):
    """The daemon could not be reached or refused the call (the message says why;
    ``code`` is the gRPC status name, e.g. ``UNAVAILABLE`` when nothing listens)."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class TLSCertMissing(ConfigError):
    """A control plane beyond loopback speaks TLS, and there is no certificate to trust."""


def tls_certificate(address: str, keys=None, cert_path: str | Path | None = None,
                    daemon_address: str | None = None,
                    insecure_ok: bool = False) -> bytes | None:
    """The certificate to pin for the control plane at ``address`` (None: plaintext).

    ``cert_path`` (``--tls-cert``) when given; else ``keys.dir``/tls/server.crt when the
    address is beyond loopback, or when it is loopback but the daemon's own address
    ``daemon_address`` is not (the daemon then speaks TLS on every interface). Beyond
    loopback without a certificate: :class:`TLSCertMissing` (one line), unless
    ``insecure_ok`` (``daemon.allow_insecure_grpc``: the daemon speaks plaintext)."""
    from capes.common.curve import TLS_CERT, is_loopback, tls_files
    if cert_path:
        try:
            return Path(cert_path).expanduser().read_bytes()
        except OSError as exc:
            raise ValueError(f"--tls-cert {cert_path}: cannot read it "
                             f"({exc.strerror or exc})") from None
    beyond = not is_loopback(address)
    files = tls_files(keys) if keys is not None else None
    if files:
        return files[0] if beyond or (daemon_address and not is_loopback(daemon_address)) \
            else None
    if beyond and not insecure_ok:
        enabled = keys is not None and getattr(keys, "enabled", True)
        where = (f"{Path(getattr(keys, 'dir', keys)) / TLS_CERT}" if enabled
                 else "keys.enabled = false")
        raise TLSCertMissing(where, "", f"no TLS certificate for {address}: beyond "
                             "loopback the control plane speaks TLS (copy the daemon's "
                             "certificate, made by `capes keys generate`, or give "
                             "--tls-cert PATH)")
    return None


def _dict(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


class ControlClient:
    """``ControlClient("127.0.0.1:50051", token=...)``; ``token`` is the contents of
    KEYS_DIR/control.token (see :func:`from_config`)."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0,
                 tls_cert: bytes | None = None):
        self.address = address
        self.timeout = timeout
        if tls_cert:       # the daemon's self-signed certificate, pinned by its name
            from capes.common.curve import TLS_NAME
            self.channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=tls_cert),
                options=[("grpc.ssl_target_name_override", TLS_NAME),
                         ("grpc.default_authority", TLS_NAME)])
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.ControlPlaneStub(self.channel)
        self.metadata = ((TOKEN_HEADER, token),) if token else ()

    @classmethod
    def from_config(cls, cfg, address: str | None = None, timeout: float = 5.0,
                    tls_cert: str | Path | None = None) -> "ControlClient":
        """A client for a :class:`capes.common.deployment.DeploymentConfig`'s daemon:
        TLS with ``tls_cert`` or ``keys.dir``/tls/server.crt unless the address (and
        the daemon's own) is loopback (see :func:`tls_certificate`)."""
        from capes.common.curve import load_token
        address = address or cfg.daemon.grpc
        cert = tls_certificate(address, cfg.keys, tls_cert, cfg.daemon.grpc,
                               cfg.daemon.allow_insecure_grpc)
        return cls(address, load_token(cfg.keys), timeout, cert)

    def _call(self, method, request):
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout,
                                              metadata=self.metadata)
        except grpc.RpcError as exc:
            raise ControlError(f"{self.address}: {method}: {exc.code().name}: "
                               f"{exc.details()}", exc.code().name) from None

    def status(self) -> dict:
        """Counters and flags: messages, bytes, drops, nodes, ticks_written, tuning,
        training, workload_epoch, session_id, db_path, parameters, actions, ..."""
        return _status(self._call("GetStatus", pb.StatusRequest()))

    def set_tuning(self, on: bool) -> dict:
        return _status(self._call("SetTuning", pb.Switch(on=on)))

    def set_training(self, on: bool) -> dict:
        return _status(self._call("SetTraining", pb.Switch(on=on)))

    def workload_changed(self, note: str = "") -> dict:
        return _status(self._call("WorkloadChanged", pb.WorkloadChangedRequest(note=note)))

    def nodes(self) -> list[dict]:
        reply = self._call("ListNodes", pb.ListNodesRequest())
        return [_node(n) for n in reply.nodes]

    def submit_action(self, tick: int, action: int, values: dict[str, float]) -> dict:
        """Submit the engine's action (absolute new values by parameter name). Returns
        accepted, reason, seq, values (every parameter's value now in effect), sent_to."""
        reply = self._call("SubmitAction", pb.ActionRequest(
            tick=tick, action=action, values={k: float(v) for k, v in values.items()}))
        return {"accepted": reply.accepted, "reason": reply.reason, "seq": reply.seq,
                "values": dict(reply.values), "sent_to": reply.sent_to}

    def health(self, service: str = "") -> str:
        """The standard gRPC health check: SERVING, NOT_SERVING, ... or UNREACHABLE."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until the daemon's channel is up."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_INTS = ("messages", "bytes", "ticks_written", "rows_written", "workload_epoch",
         "session_id", "latest_tick", "full_requests", "commits", "auth_denied")


def _status(msg: pb.Status) -> dict:
    """Status as a dict with Python types (protobuf JSON writes 64-bit ints as text)."""
    out = _dict(msg)
    for k in _INTS:
        out[k] = int(out[k])
    out["drops"] = {k: int(v) for k, v in out["drops"].items()}
    out["actions"] = {k: int(v) for k, v in out["actions"].items()}
    out["parameters"] = dict(msg.parameters)
    return out


def _node(msg: pb.NodeInfo) -> dict:
    out = _dict(msg)
    for k in ("last_tick", "messages", "action_seq", "acked_seq"):
        out[k] = int(out[k])
    out["applied"] = dict(msg.applied)
    return out
