"""The worker's side of cache events (``--cache-events-port``): a ZeroMQ PUB socket the scheduler
process publishes its radix cache's changes on, one ``EventBatch`` per step (``mem.cache_events``).

Addresses: the socket binds ``tcp://<--host>:<port>`` (rank r of ``--dp-size`` binds port + r).
What ``/get_server_info`` reports for a router to connect to is the same address, except when
``--host`` is a wildcard (0.0.0.0, ::): a router cannot connect to a wildcard, so the machine's
hostname is reported when it resolves (a router elsewhere can reach it, a router on this machine
too), else 127.0.0.1 (then only a router on this machine can).
"""

from __future__ import annotations

import functools
import socket

import zmq

from radixserve.mem.cache_events import EventBatcher, encode_batch

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Batches a slow or absent subscriber may leave queued before PUB drops new ones; a dropped batch
# is a break in ``seq``, on which the router stops trusting what it knew of this worker.
SNDHWM = 10_000


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_endpoint(host: str, port: int) -> str:
    return _tcp(host or "0.0.0.0", port)


@functools.cache
def advertised_host(host: str) -> str:
    """The address a router can connect to for a server bound to ``host`` (see the module doc)."""
    if host not in WILDCARD_HOSTS:
        return host
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return "127.0.0.1"
    return name


def advertised_endpoints(host: str, port: int | None, dp_size: int = 1) -> list[str]:
    """Each rank's endpoint as ``/get_server_info`` reports it; [] when cache events are off."""
    if port is None:
        return []
    h = advertised_host(host)
    return [_tcp(h, port + r) for r in range(dp_size)]


class CacheEventPublisher:
    """Collects a step's events (``add``, the cache's ``event_sink``) and sends them as one batch
    (``flush``, once per step). Sending never blocks the scheduler: with no subscriber the batch
    is dropped by ZeroMQ, past ``SNDHWM`` queued batches too."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.batcher = EventBatcher()
        self.add = self.batcher.add
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        if endpoint.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)  # also makes a [::] bind take IPv4 (dual stack)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.sock.close()
            raise OSError(f"cannot bind the cache events socket at {endpoint}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port for a "*" port
        self.sent = 0

    def flush(self) -> bool:
        """Send what the step reported, if anything; True when a batch went out."""
        batch = self.batcher.take()
        if batch is None:
            return False
        try:
            self.sock.send(encode_batch(batch), zmq.NOBLOCK)
        except zmq.Again:  # the subscriber will see the break in seq
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self.sock.close(linger=0)
