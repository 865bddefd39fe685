"""The gRPC control plane of the interface daemon (``capes/control_plane.proto``).

Handlers run on gRPC's threads; every one of them hands its work to the daemon's loop
thread through ``daemon.call`` so the daemon's state has a single owner. With keys
enabled, each call must carry the ``x-capes-token`` metadata (the contents of
``KEYS_DIR/control.token``); the standard health service needs no token. Health is
NOT_SERVING while the replay DB cannot be written (see :func:`set_serving`).

On an address other computers can reach (anything but loopback) the control plane
speaks TLS with the certificate ``capes keys generate`` makes (``KEYS_DIR/tls``), and
refuses to start without one unless ``daemon.allow_insecure_grpc = true``.
"""
from __future__ import annotations

import hmac
import socket
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from capes.common import control_plane_pb2 as pb
from capes.common import control_plane_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
TOKEN_HEADER = "x-capes-token"


class ControlPlane(pb_grpc.ControlPlaneServicer):
    def __init__(self, daemon, token: str | None):
        self.daemon = daemon
        self.token = token

    def _auth(self, context) -> None:
        if self.token is None:
            return
        sent = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"missing or wrong {TOKEN_HEADER} (see KEYS_DIR/control.token)")

    def _status(self, context) -> pb.Status:
        return pb.Status(**self.daemon.call(self.daemon.status))

    def GetStatus(self, request, context):
        self._auth(context)
        return self._status(context)

    def SetTuning(self, request, context):
        self._auth(context)
        self.daemon.call(lambda: self.daemon.set_flag("tuning", request.on))
        return self._status(context)

    def SetTraining(self, request, context):
        self._auth(context)
        self.daemon.call(lambda: self.daemon.set_flag("training", request.on))
        return self._status(context)

    def WorkloadChanged(self, request, context):
        self._auth(context)
        self.daemon.call(lambda: self.daemon.workload_changed(request.note))
        return self._status(context)

    def ListNodes(self, request, context):
        self._auth(context)
        nodes = self.daemon.call(self.daemon.nodes)
        return pb.NodeList(nodes=[pb.NodeInfo(**n) for n in nodes])

    def SubmitAction(self, request, context):
        self._auth(context)
        reply = self.daemon.call(lambda: self.daemon.submit_action(
            request.tick, request.action, dict(request.values)))
        return pb.ActionReply(**reply)


def start_server(daemon, address: str, token: str | None, workers: int = 4
                 ) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Start the control plane (plus health and reflection) on ``address``;
    return the server, its health servicer and the bound port (``host:0`` = any free)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                    thread_name_prefix="capes-grpc"))
    pb_grpc.add_ControlPlaneServicer_to_server(ControlPlane(daemon, token), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    _resolve(address)
    tls = _tls_credentials(daemon, address)
    daemon.grpc_tls = tls is not None
    try:
        port = (server.add_secure_port(address, tls) if tls is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    server.start()
    set_serving(health_servicer, True)
    return server, health_servicer, port


def _tls_credentials(daemon, address: str) -> grpc.ServerCredentials | None:
    """TLS for an address other computers can reach (``keys.dir``/tls, made by ``capes
    keys generate``); None on loopback. Without a certificate a non-loopback address is
    refused unless ``daemon.allow_insecure_grpc`` (the token would cross the network
    in clear text)."""
    from capes.common import curve
    cfg = getattr(daemon, "cfg", None)
    if cfg is None or curve.is_loopback(address):
        return None
    files = curve.tls_files(cfg.keys)
    if files is not None and files[1]:
        return grpc.ssl_server_credentials([(files[1], files[0])])
    if getattr(cfg.daemon, "allow_insecure_grpc", False):
        return None
    where = f"{cfg.keys.dir}/{curve.TLS_KEY}" if cfg.keys.enabled else "keys.enabled = false"
    raise OSError(f"cannot listen for gRPC on {address} without TLS ({where}: no "
                  "certificate and key; run `capes keys generate`, or set "
                  "daemon.allow_insecure_grpc = true to send the token in clear text)")


def _resolve(address: str) -> None:
    """Fail with one clear line on a host that does not resolve (gRPC's own error comes
    with a C-core log line)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():              # unix:PATH and other forms: gRPC's own check
        return
    try:
        socket.getaddrinfo(host.strip("[]") or None, int(port))
    except (socket.gaierror, ValueError) as exc:
        raise OSError(f"cannot listen for gRPC on {address}: "
                      f"{getattr(exc, 'strerror', None) or exc}") from None


def set_serving(health_servicer: health.HealthServicer | None, serving: bool) -> None:
    """Report SERVING or NOT_SERVING for the daemon and its control plane."""
    if health_servicer is None:
        return
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE):
        health_servicer.set(name, status)


def stop_server(server: grpc.Server, health_servicer: health.HealthServicer) -> None:
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=0.5).wait(2)
