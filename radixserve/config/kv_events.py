"""``--kv-events-config``: vLLM's and SGLang's JSON for publishing KV cache events (their keys,
their defaults), read into ``KVEventsConfig``; a key neither defines is an error at start."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

FORMATS = ("default",)


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "zmq"  # "zmq" publishes, "null" does not
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound if it has a wildcard, else connected
    replay_endpoint: str | None = None  # a ROUTER socket serving missed batches from the buffer
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # vLLM's queue bound (batches are sent as taken here: none queue)
    topic: str = ""
    enable_kv_cache_events: bool = True  # vLLM's switch: false publishes nothing
    bind: bool | None = None  # SGLang's: bind (true) or connect (false) whatever the endpoint
    format: str = "default"  # SGLang's: only its default (vLLM's schema)

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """``ValueError`` naming what is wrong."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("kv_events_config must be a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        if "publisher" not in d and d.get("enable_kv_cache_events") is False:
            d["publisher"] = "null"
        cfg = cls(**d)
        problems = []
        if cfg.publisher not in ("zmq", "null"):
            problems.append(f"publisher must be zmq or null, got {cfg.publisher!r}")
        if cfg.format not in FORMATS:
            problems.append(f"format must be one of {', '.join(FORMATS)}, got {cfg.format!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                problems.append(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, name), str):
                problems.append(f"{name} must be a string")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            problems.append("replay_endpoint must be a string")
        if problems:
            raise ValueError("kv_events_config: " + "; ".join(problems))
        return cfg
