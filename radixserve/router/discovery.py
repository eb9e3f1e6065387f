"""Workers listed in a file the router watches (``--discovery-file``): workers come and go live.

The file is JSON, or YAML when its name ends in ``.yaml`` / ``.yml``: a list (or ``{"workers":
[...]}``) whose entries are a URL, or ``{"url": ..., "role": "prefill" | "decode",
"bootstrap_port": N}`` for prefill/decode disaggregation. Every ``--discovery-interval-secs`` the
router reads it again when it changed, and adds the workers it lists that the fleet lacks and
removes the ones it added that the file no longer lists (their requests in flight finish; workers
given on the command line stay). A file that cannot be read or parsed changes nothing (logged):
a half-written file never empties the fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("radixserve.router")


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


class FileDiscovery:
    def __init__(self, path: str, fleet: FleetLike, interval: float) -> None:
        self.path = path
        self.fleet = fleet
        self.interval = interval
        self.added: set[str] = set()  # the workers this file brought (the others are not its to remove)
        self.seen: tuple[float, int] | None = None  # the file's (mtime, size) when last read
        self.errors = 0

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
            logger.warning("--discovery-file %s: %s; the fleet is left as it is", self.path, e)
            return None
        self.seen = (st.st_mtime, st.st_size)
        return entries

    async def sync(self) -> None:
        entries = self.read()
        if entries is None:
            return
        want = {e.url: e for e in entries}
        for url in sorted(self.added - set(want)):
            self.added.discard(url)
            await self.fleet.remove_worker(url)
        new = [e for e in entries if e.url not in self.fleet.workers]
        for e in new:
            try:
                await self.fleet.add_worker(e.url, role=e.role, bootstrap_port=e.bootstrap_port)
            except ValueError as err:  # e.g. a role this router does not take
                logger.warning("--discovery-file %s: %s", self.path, err)
                continue
            self.added.add(e.url)
        if new or len(want) != len(entries):
            logger.info("--discovery-file %s: %d worker(s) listed", self.path, len(want))

    async def run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.interval)
