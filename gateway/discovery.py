"""Which nodes the gateway routes across: ``--node`` flags, a node file, or Kubernetes DNS.

A *node* is one cache service (one pool, one accelerator) and the compute replicas attached to
it. Static nodes come from ``--node [NAME@]CACHE=COMPUTE[,...]`` or a JSON node file; with
``--nodes-dns`` the cache pods and replica pods are the addresses two headless Services resolve
to, resolved again every ``DNS_PERIOD_S`` (``rediscover_forever``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvtier.gateway.router")

DNS_PERIOD_S = 10.0  # how often --nodes-dns Services are resolved again


class NoNode(Exception):
    """No node to route to (DNS discovery found none yet)."""


class NodeFileError(ValueError):
    """A node file or --node flag that cannot be used; the message says what to fix."""


@dataclass
class Node:
    """One cache service and the compute replicas attached to it."""

    name: str
    cache: str  # the cache service's address (unix:///path or host:port)
    compute: list[str]  # its replicas' addresses
    # DNS discovery: every replica found; the node's own are those its cache lists as leases.
    candidates: list[str] | None = None


def parse_node_flag(spec: str, index: int) -> Node:
    """``CACHE=COMPUTE[,COMPUTE...]`` (``--node``), optionally prefixed ``NAME@``."""
    name, _, rest = spec.rpartition("@") if "@" in spec.split("=", 1)[0] else ("", "", spec)
    cache, sep, compute = rest.partition("=")
    replicas = [c for c in compute.split(",") if c]
    if not sep or not cache or not replicas:
        raise NodeFileError(
            f"--node {spec!r}: expected [NAME@]CACHE_ADDRESS=COMPUTE_ADDRESS[,COMPUTE_ADDRESS...], e.g. "
            "unix:///run/kvtier-0/cache.sock=unix:///run/kvtier-0/compute-0.sock"
        )
    return Node(name or f"node-{index}", cache, replicas)


def load_node_file(path: str | Path) -> list[Node]:
    """Nodes from a JSON file: ``{"nodes": [{"name": "gpu0", "cache": ADDR, "compute": [ADDR, ...]}]}``."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise NodeFileError(f"node file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise NodeFileError(f"node file {path}: not JSON ({e})") from None
    entries = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise NodeFileError(
            f'node file {path}: expected {{"nodes": [{{"cache": ..., "compute": [...]}}, ...]}}'
        )
    nodes = [_node_entry(entry, f"node file {path}: nodes[{k}]", k) for k, entry in enumerate(entries)]
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise NodeFileError(f"node file {path}: node names repeat: {names}")
    return nodes


def _node_entry(entry: object, where: str, k: int) -> Node:
    """One entry of a node file, checked field by field."""
    if not isinstance(entry, dict):
        raise NodeFileError(f"{where} is not an object")
    cache, compute = entry.get("cache"), entry.get("compute")
    if not isinstance(cache, str) or not cache:
        raise NodeFileError(f'{where} needs "cache": the cache service address')
    if not isinstance(compute, list) or not compute or not all(isinstance(c, str) and c for c in compute):
        raise NodeFileError(f'{where} needs "compute": a non-empty list of replica addresses')
    name = entry.get("name", f"node-{k}")
    if not isinstance(name, str) or not name:
        raise NodeFileError(f'{where}: "name" must be a non-empty string')
    return Node(name, cache, list(compute))


def dns_addresses(service: str) -> list[str]:
    """``HOST:PORT`` of every address ``HOST`` resolves to (a headless Service: one per ready pod)."""
    host, _, port = service.rpartition(":")
    if not host or not port.isdigit():
        raise NodeFileError(f"{service!r}: expected HOST:PORT of a headless Service")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NodeFileError(f"cannot resolve {host}: {e.strerror}") from None
    return sorted({f"{info[4][0]}:{port}" for info in infos})


def parse_dns_flag(value: str) -> tuple[str, str]:
    """``--nodes-dns CACHE_HOST:PORT,COMPUTE_HOST:PORT`` -> the two services (not resolved yet)."""
    cache_service, _, compute_service = value.partition(",")
    for service in (cache_service, compute_service):
        host, _, port = service.rpartition(":")
        if not host or not port.isdigit():
            raise NodeFileError(f"--nodes-dns {value!r}: expected CACHE_HOST:PORT,COMPUTE_HOST:PORT")
    return cache_service, compute_service


async def rediscover_forever(
    dns: tuple[str, str], found: Callable[[list[str], list[str]], Awaitable[None]]
) -> None:
    """Resolve the (cache, compute) Services every DNS_PERIOD_S and hand ``found(caches,
    replicas)`` the addresses. A failed lookup (no ready pod yet, DNS down) is logged once and
    retried, never fatal. Runs until cancelled."""
    cache_service, compute_service = dns
    failing = False
    while True:
        try:
            caches = await asyncio.to_thread(dns_addresses, cache_service)
            replicas = await asyncio.to_thread(dns_addresses, compute_service)
        except NodeFileError as e:
            if not failing:
                log.warning("router: %s; retrying every %.0fs", e, DNS_PERIOD_S)
            failing = True
        else:
            failing = False
            await found(caches, replicas)
        await asyncio.sleep(DNS_PERIOD_S)
