"""The gRPC control plane of the interface daemon (``capes/control_plane.proto``).

Handlers run on gRPC's threads; every one of them hands its work to the daemon's loop
thread through ``daemon.call`` so the daemon's state has a single owner. With keys
enabled, each call must carry the ``x-capes-token`` metadata (the contents of
``KEYS_DIR/control.token``), checked by an interceptor before any handler runs; only the
health service's ``Check`` (one short unary call) needs no token. Health is NOT_SERVING
while the replay DB cannot be written (see :func:`set_serving`).

Nobody without the token can hold a worker thread: every other method, streams
included, is refused before it starts. Reflection is off unless
``daemon.grpc_reflection`` (and then behind the token too). Calls beyond
``MAX_CONCURRENT_RPCS`` are refused at once (RESOURCE_EXHAUSTED) rather than queued,
requests are at most ``MAX_RECEIVE_BYTES``, one connection carries at most
``MAX_STREAMS_PER_CONNECTION`` calls at a time, and idle or half-open connections are
closed (``SERVER_OPTIONS``).

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

from capes.common import control_plane_pb2 as pb
from capes.common import control_plane_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
TOKEN_HEADER = "x-capes-token"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})     # no token needed

WORKERS = 8                      # handler threads
MAX_CONCURRENT_RPCS = 32         # beyond: RESOURCE_EXHAUSTED at once, no thread taken
MAX_RECEIVE_BYTES = 64 << 10     # the largest request (an action with its values) is < 1 kB
MAX_STREAMS_PER_CONNECTION = 8
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.max_connection_idle_ms", 5 * 60_000),      # a connection with no call: closed
    ("grpc.server_handshake_timeout_ms", 10_000),     # TLS/HTTP2 handshake half-sent
]


class TokenCheck(grpc.ServerInterceptor):
    """Refuse every call without the right ``x-capes-token`` before its handler runs
    (the refusal itself takes no time), except the methods in ``OPEN_METHODS``."""

    def __init__(self, token: str):
        self.token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        sent = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self.token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"missing or wrong {TOKEN_HEADER} (see KEYS_DIR/control.token)")
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(bool(handler.request_streaming), bool(handler.response_streaming))](deny)


class ControlPlane(pb_grpc.ControlPlaneServicer):
    def __init__(self, daemon):
        self.daemon = daemon

    def _status(self, context) -> pb.Status:
        return pb.Status(**self.daemon.call(self.daemon.status))

    def GetStatus(self, request, context):
        return self._status(context)

    def SetTuning(self, request, context):
        self.daemon.call(lambda: self.daemon.set_flag("tuning", request.on))
        return self._status(context)

    def SetTraining(self, request, context):
        self.daemon.call(lambda: self.daemon.set_flag("training", request.on))
        return self._status(context)

    def WorkloadChanged(self, request, context):
        self.daemon.call(lambda: self.daemon.workload_changed(request.note))
        return self._status(context)

    def ListNodes(self, request, context):
        nodes = self.daemon.call(self.daemon.nodes)
        return pb.NodeList(nodes=[pb.NodeInfo(**n) for n in nodes])

    def SubmitAction(self, request, context):
        reply = self.daemon.call(lambda: self.daemon.submit_action(
            request.tick, request.action, dict(request.values)))
        return pb.ActionReply(**reply)


def start_server(daemon, address: str, token: str | None, workers: int = WORKERS,
                 reflect: bool = False) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Start the control plane (plus health, and reflection when ``reflect``) on
    ``address``; return the server, its health servicer and the bound port (``host:0``
    = any free). ``token`` None: no token check (keys disabled)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                    thread_name_prefix="capes-grpc"),
                         interceptors=[TokenCheck(token)] if token is not None else [],
                         options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    pb_grpc.add_ControlPlaneServicer_to_server(ControlPlane(daemon), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflect:
        from grpc_reflection.v1alpha import reflection   # only when asked for
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
