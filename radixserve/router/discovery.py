"""Workers listed in a file the router watches (``--discovery-file``): workers come and go live.

The file is JSON, or YAML when its name ends in ``.yaml`` / ``.yml``: a list (or ``{"workers":
[...]}``) whose entries are a URL, or ``{"url": ..., "role": "prefill" | "decode",
"bootstrap_port": N}`` for prefill/decode disaggregation. Every ``--discovery-interval-secs`` the
router reads it again when it changed, and adds the workers it lists that the fleet lacks and
removes the ones it added that the file no longer lists (their requests in flight finish; workers
given on the command line stay). A file that cannot be read or parsed changes nothing (logged):
a half-written file never empties the fleet.

``Reconciler`` is that last step, shared with ``--discovery-provider kubernetes``
(kube_discovery.py), which lists pods instead of reading a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("radixserve.router")


def provider(args: Any) -> str | None:
    """The discovery provider a ``RouterArgs`` asks for: the one it names, else file when it gives a
    file; None without discovery."""
    return args.discovery_provider or ("file" if args.discovery_file is not None else None)


class DiscoveryError(Exception):
    """A discovery source that cannot work at all (no credentials, no client): the router does not start."""


@dataclass(frozen=True)
class WorkerEntry:
    url: str
    role: str | None = None
    bootstrap_port: int | None = None


class FleetLike(Protocol):
    workers: dict[str, Any]

    async def add_worker(self, url: str, wait: bool = False, role: str | None = None,
                         bootstrap_port: int | None = None) -> Any: ...

    async def remove_worker(self, url: str) -> bool: ...


def parse_workers(text: str, yaml_file: bool) -> list[WorkerEntry]:
    """``ValueError`` naming what is wrong."""
    if yaml_file:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"not YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
    if isinstance(data, dict):
        data = data.get("workers")
    if not isinstance(data, list):
        raise ValueError("expected a list of workers (or {\"workers\": [...]})")
    out = []
    for i, item in enumerate(data):
        entry = {"url": item} if isinstance(item, str) else item
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ValueError(f"worker {i}: a URL, or an object with a url")
        url = entry["url"].rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker {i}: {url!r} must start with http:// or https://")
        role, port = entry.get("role"), entry.get("bootstrap_port")
        if role not in (None, "prefill", "decode"):
            raise ValueError(f"worker {i}: role must be prefill or decode, got {role!r}")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"worker {i}: bootstrap_port must be a port number, got {port!r}")
        extra = set(entry) - {"url", "role", "bootstrap_port"}
        if extra:
            raise ValueError(f"worker {i}: unknown key(s) {', '.join(sorted(extra))}")
        out.append(WorkerEntry(url, role, port))
    return out


class Reconciler:
    """Brings the fleet in line with a discovery source's list: adds the workers it lists that the
    fleet lacks, removes the ones it added that it no longer lists (their requests in flight finish).
    Workers given on the command line or through the admin API are not its to remove."""

    source = "discovery"

    def __init__(self, fleet: FleetLike) -> None:
        self.fleet = fleet
        self.added: set[str] = set()  # the workers this source brought
        self.errors = 0

    async def apply(self, entries: list[WorkerEntry]) -> None:
        want = {e.url: e for e in entries}
        for url in sorted(self.added - set(want)):
            self.added.discard(url)
            await self.fleet.remove_worker(url)
        new = [e for e in want.values() if e.url not in self.fleet.workers]
        for e in new:
            try:
                await self.fleet.add_worker(e.url, role=e.role, bootstrap_port=e.bootstrap_port)
            except ValueError as err:  # e.g. a role this router does not take
                logger.warning("%s: %s", self.source, err)
                continue
            self.added.add(e.url)
        if new:
            logger.info("%s: %d worker(s) listed", self.source, len(want))


class FileDiscovery(Reconciler):
    def __init__(self, path: str, fleet: FleetLike, interval: float) -> None:
        super().__init__(fleet)
        self.path = path
        self.source = f"--discovery-file {path}"
        self.interval = interval
        self.seen: tuple[float, int] | None = None  # the file's (mtime, size) when last read

    def read(self) -> list[WorkerEntry] | None:
        """The file's workers when it changed since the last read (None: unchanged, or unreadable)."""
        try:
            st = os.stat(self.path)
            if self.seen == (st.st_mtime, st.st_size):
                return None
            with open(self.path) as f:
                text = f.read()
            entries = parse_workers(text, self.path.endswith((".yaml", ".yml")))
        except (OSError, ValueError) as e:
            self.errors += 1
            logger.warning("%s: %s; the fleet is left as it is", self.source, e)
            return None
        self.seen = (st.st_mtime, st.st_size)
        return entries

    async def sync(self) -> None:
        entries = self.read()
        if entries is not None:
            await self.apply(entries)

    async def run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.interval)

    def stop(self) -> None:
        pass
