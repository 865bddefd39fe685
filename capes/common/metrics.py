"""Prometheus metrics and TensorBoard scalars for the CAPES processes.

Each process keeps its own :class:`~prometheus_client.CollectorRegistry` (never the
global one) and describes its metrics as a table of :class:`MetricSpec`. At every scrape
a :class:`SnapshotCollector` asks the process for one plain dict (``name -> value``,
``name -> {label values: value}`` or, for a histogram, a :class:`Histogram`) and turns it
into metric families, so the process's state keeps a single owner (the interface
daemon's snapshot is taken on its loop thread) and nothing is counted twice.

``serve_metrics`` starts the HTTP endpoint (``/metrics``) on ``host:port`` from the
config; ``""`` turns it off, port 0 picks a free one. A port that cannot be bound is
logged and the process goes on without metrics: tuning never stops for its dashboard.

The metric names are listed in ``docs/metrics.md`` (a test keeps them in step).
"""
from __future__ import annotations

import bisect
import collections
import http.server
import io
import logging
import math
import re
import socket
import socketserver
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

log = logging.getLogger("capes.metrics")

DEFAULT_DAEMON_METRICS = "127.0.0.1:9464"
DEFAULT_ENGINE_METRICS = "127.0.0.1:9465"
TENSORBOARD_MISSING = ("--tensorboard needs the tensorboard package: "
                       "pip install 'capes[tensorboard]' (or: pip install tensorboard)")


@dataclass(frozen=True)
class MetricSpec:
    name: str                       # counters end in _total
    kind: str                       # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()


def metric(name: str, kind: str, help: str, *labels: str) -> MetricSpec:
    """A :class:`MetricSpec` with its labels as trailing arguments: a component's table
    of metrics reads one metric per call."""
    return MetricSpec(name, kind, help, labels)


@dataclass
class Histogram:
    """A cumulative-free latency histogram kept by the component itself (no
    prometheus_client needed there): ``observe`` counts into the first bucket whose
    upper bound is >= the value; the last bucket is +Inf."""
    bounds: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                 0.25, 0.5, 1.0, 2.5)
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    max: float = 0.0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.max = max(self.max, value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.sum, self.max)


def parse_address(text: str) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"``, ``"[::1]:9464"``, ``"0.0.0.0:0"`` -> (host, port);
    ``""`` -> None (metrics off). ValueError for anything else."""
    text = (text or "").strip()
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464) or \"\" for off, "
                         f"got {text!r}")
    return host.strip("[]"), int(port)


class SnapshotCollector:
    """Renders ``snapshot()`` (a dict, or None when there is nothing to show) through
    ``specs``. Missing names are left out; a failing snapshot yields nothing."""

    def __init__(self, specs: Iterable[MetricSpec], snapshot: Callable[[], dict | None]):
        self.specs = list(specs)
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        try:
            values = self.snapshot()
        except Exception as exc:          # a scrape must never take the process down
            log.debug("metrics snapshot failed: %s", exc)
            values = None
        if not values:
            return
        for spec in self.specs:
            value = values.get(spec.name)
            if value is None:
                continue
            if spec.kind == "histogram":
                cum, buckets = 0, []
                for bound, n in zip(list(value.bounds) + [math.inf], value.counts):
                    cum += n
                    buckets.append(("+Inf" if bound == math.inf else repr(bound), cum))
                yield HistogramMetricFamily(spec.name, spec.help, buckets=buckets,
                                            sum_value=value.sum)
                continue
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            if not spec.labels:
                yield cls(spec.name, spec.help, value=float(value))
                continue
            fam = cls(spec.name, spec.help, labels=list(spec.labels))
            for key, v in sorted(value.items()):
                key = key if isinstance(key, tuple) else (key,)
                if v is not None:
                    fam.add_metric([str(k) for k in key], float(v))
            yield fam


BUILD_INFO = "capes_build"     # exposed as capes_build_info{version, python} 1


def registry_for(specs: Iterable[MetricSpec], snapshot: Callable[[], dict | None]):
    """A fresh per-process registry holding one :class:`SnapshotCollector`, plus the
    standard ``process_*`` metrics (CPU seconds, resident memory, open files, start time:
    prometheus_client's process collector, Linux) and ``capes_build_info`` (the CAPES
    and Python versions, value 1), which every dashboard can join on."""
    import platform

    from prometheus_client import CollectorRegistry, Info, ProcessCollector

    from capes import __version__
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(specs, snapshot))
    ProcessCollector(registry=registry)
    Info(BUILD_INFO, "the CAPES build this process runs", registry=registry).info(
        {"version": __version__, "python": platform.python_version()})
    return registry


class MetricsServer:
    """``/metrics`` over HTTP for one registry, on a thread of its own, bounded: at most
    ``MAX_CONNECTIONS`` connections are handled at once (one thread each), a request
    must arrive whole within ``REQUEST_DEADLINE_S`` and fit ``MAX_REQUEST_BYTES``, and
    when every slot is taken a new connection evicts the oldest one still sending its
    request. Half-sent requests therefore pin no thread for long, and a scraper (which
    sends its request at once) always gets in."""

    MAX_CONNECTIONS = 16
    REQUEST_DEADLINE_S = 5.0
    MAX_REQUEST_BYTES = 16 << 10

    def __init__(self, registry, host: str, port: int):
        self.httpd = _BoundedHTTPServer(registry, host, port, self.MAX_CONNECTIONS,
                                        self.REQUEST_DEADLINE_S, self.MAX_REQUEST_BYTES)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="capes-metrics",
                                       kwargs={"poll_interval": 0.5}, daemon=True)
        self.thread.start()
        self.host = host
        self.port = self.httpd.server_port

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(2)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """Answers GET (any path) with the registry's metrics; the request head was read
    by the server within its deadline."""
    protocol_version = "HTTP/1.0"           # one request per connection

    def setup(self):
        self.timeout = self.server.deadline_s    # each later send or recv
        super().setup()
        self.rfile = io.BytesIO(self.server.read_head(self.connection))

    def do_GET(self):
        from prometheus_client.exposition import choose_encoder
        encoder, content_type = choose_encoder(self.headers.get("Accept"))
        body = encoder(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        log.debug("metrics %s: " + format, self.client_address[0], *args)


class _BoundedHTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """One thread per connection, at most ``max_connections`` of them (see
    :class:`MetricsServer`)."""
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64

    def __init__(self, registry, host, port, max_connections, deadline_s, max_bytes):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry, self.deadline_s, self.max_bytes = registry, deadline_s, max_bytes
        self.max_connections = max_connections
        self.lock = threading.Lock()
        self.held: set = set()                  # connections holding a slot (a thread)
        self.reading: collections.OrderedDict = collections.OrderedDict()  # sock -> None
        super().__init__((host, port), _MetricsHandler)

    def process_request(self, request, client_address):
        """Give the connection a slot, taking the one of the oldest connection still
        sending its request when all are held (it is shut down and its thread ends at
        once); never waits, so the accept loop keeps up with a flood of connections."""
        victim = None
        with self.lock:
            if len(self.held) >= self.max_connections:
                victim = next(iter(self.reading), None)
                if victim is not None:
                    del self.reading[victim]
                    self.held.discard(victim)
            admit = len(self.held) < self.max_connections
            if admit:
                self.held.add(request)
                if not self._head_arrived(request):   # a scraper's, sent at once: kept
                    self.reading[request] = None
        if victim is not None:
            try:
                victim.shutdown(socket.SHUT_RDWR)       # its recv returns at once
            except OSError:
                pass
        if not admit:
            self.shutdown_request(request)              # every slot is answering
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request) -> None:
        with self.lock:
            self.reading.pop(request, None)
            self.held.discard(request)

    @staticmethod
    def _head_arrived(sock) -> bool:
        """Whether the request line and headers wait, complete, in the buffer of a
        socket just accepted (blocking mode, no other reader yet)."""
        try:
            data = sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:                 # nothing there yet (EAGAIN), or gone
            return False
        return b"\r\n\r\n" in data

    def read_head(self, sock) -> bytes:
        """The request line and headers, read within the deadline (b"" when the
        peer is too slow, sends too much, or was evicted)."""
        deadline = time.monotonic() + self.deadline_s
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) <= self.max_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return b""
                sock.settimeout(left)
                chunk = sock.recv(4096)
                if not chunk:
                    return b""
                head += chunk
        except OSError:
            return b""
        finally:
            with self.lock:
                self.reading.pop(sock, None)        # no longer evictable
            try:
                sock.settimeout(self.deadline_s)
            except OSError:
                pass
        return head if len(head) <= self.max_bytes else b""


def serve_metrics(registry, address: str, what: str) -> MetricsServer | None:
    """Serve ``registry`` on ``address`` (None when off or when the port cannot be
    bound: that is logged, and the process goes on without metrics)."""
    where = parse_address(address)
    if where is None:
        return None
    try:
        server = MetricsServer(registry, *where)
    except OSError as exc:
        log.error("%s metrics not served: cannot listen on %s (%s); it runs on without "
                  "them", what, address, exc.strerror or exc)
        return None
    if where[0] not in ("127.0.0.1", "localhost", "::1"):
        log.info("%s metrics on %s: reachable from other hosts (no authentication)",
                 what, server.url)
    return server


# ---------------------------------------------------------------------------- reading

def scrape(address: str, timeout: float = 2.0) -> dict[str, dict[tuple, float]]:
    """Read ``http://ADDRESS/metrics``: ``{sample name: {((label, value), ...): value}}``.
    Raises OSError when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families
    url = address if "://" in address else f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode("utf-8", "replace")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(samples: dict[str, dict[tuple, float]], name: str) -> float | None:
    """The value of an unlabelled sample, or None."""
    return samples.get(name, {}).get((), None)


def by_label(samples: dict[str, dict[tuple, float]], name: str, label: str) -> dict[str, float]:
    """``{label value: value}`` of a sample with one label."""
    return {dict(k)[label]: v for k, v in samples.get(name, {}).items() if label in dict(k)}


# ---------------------------------------------------------------------------- TensorBoard

def tensorboard_writer(logdir: str, flush_secs: int = 10):
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``logdir``; RuntimeError with one
    clear line when the optional ``tensorboard`` package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RuntimeError(TENSORBOARD_MISSING) from None
    return SummaryWriter(log_dir=str(logdir), flush_secs=flush_secs)


def tensorboard_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------- time

def iso(t: float | None) -> str | None:
    """Unix seconds as ISO 8601 UTC (``2026-01-31T12:00:00Z``); None stays None."""
    if t is None or not math.isfinite(t):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def tick_text(tick: int | None, tick_seconds: float) -> str:
    """A tick as its number and its wall time: ``34567890 (2026-01-31T12:00:00Z)``."""
    if tick is None or tick < 0:
        return "-"
    return f"{tick} ({iso(tick * tick_seconds)})"


def fmt(value: Any, spec: str = ".4g", none: str = "-") -> str:
    """A figure for a user: ``spec`` as in ``format``, but a ``g`` spec never turns to
    e-notation (:func:`capes.common.plain_numbers.plain`)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    m = re.fullmatch(r"\.(\d+)g", spec)
    if m:
        from capes.common.plain_numbers import plain
        return plain(value, int(m.group(1)), none)
    return format(value, spec)
