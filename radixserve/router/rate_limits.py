"""Per-tenant rate limits at the router (``--tenant-rate-limit-config FILE``).

The file is JSON::

    {"default": {"requests_per_second": 2, "request_burst": 4,
                 "tokens_per_second": 2000, "token_burst": 8000},
     "tenants": {"acme": {"requests_per_second": 20, "request_burst": 40},
                 "batch-jobs": {"tokens_per_second": 500}}}

A tenant (the ``x-tenant`` header, else the body's OpenAI ``user``, else its ``tenant``; none is
the tenant ``""``) has its own entry's limits, each one it leaves out taken from ``default``; a
limit set nowhere is no limit. Each limit is a token bucket: it holds up to its burst (default: one
second's worth, at least 1), refills at its rate, and a request takes 1 from the requests bucket
and its cost from the tokens bucket (the router's estimate, as its queue uses: the body's bytes / 4
plus its output budget; a cost above the burst counts as the burst, so a large request still passes
when its tenant has been idle). When either bucket lacks it, the request is refused at once with
429 ``rate_limit_exceeded`` and a ``Retry-After`` of the seconds until both would hold enough, and
nothing is taken. Refused requests never wait in the router's queue, so a tenant over its limit
never delays another tenant.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

_LIMIT_KEYS = ("requests_per_second", "request_burst", "tokens_per_second", "token_burst")


@dataclass
class Bucket:
    rate: float  # refill per second
    burst: float  # capacity
    level: float = -1.0  # -1: full (set on first use)
    at: float = 0.0  # when ``level`` was last brought up to date

    def refill(self, now: float) -> None:
        if self.level < 0:
            self.level = self.burst
        else:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` (capped at the burst) is in the bucket (0: it is now)."""
        need = min(amount, self.burst) - self.level
        return 0.0 if need <= 0 else need / self.rate


@dataclass
class TenantLimits:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    buckets: list[Bucket] = field(default_factory=list)


class RateLimits:
    def __init__(self, default: dict[str, float], tenants: dict[str, dict[str, float]]) -> None:
        self.default = default
        self.configured = tenants
        self.limits: dict[str, TenantLimits] = {}

    @classmethod
    def from_file(cls, path: str) -> RateLimits:
        """``ValueError`` naming what is wrong with the file."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"--tenant-rate-limit-config: cannot read {path}: {e.strerror}") from None
        except ValueError as e:
            raise ValueError(f"--tenant-rate-limit-config: {path} is not JSON: {e}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, where: str = "the config") -> RateLimits:
        if not isinstance(data, dict) or set(data) - {"default", "tenants"}:
            raise ValueError(f"--tenant-rate-limit-config: {where} must be an object with 'default' and/or 'tenants'")
        tenants = data.get("tenants") or {}
        if not isinstance(tenants, dict):
            raise ValueError(f"--tenant-rate-limit-config: 'tenants' in {where} must map tenant names to limits")
        entries = {"default": data.get("default") or {}, **{f"tenants.{k}": v for k, v in tenants.items()}}
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                raise ValueError(f"--tenant-rate-limit-config: {name} must be an object of limits")
            for key, value in entry.items():
                if key not in _LIMIT_KEYS:
                    raise ValueError(f"--tenant-rate-limit-config: {name}.{key} is not a limit "
                                     f"(one of {', '.join(_LIMIT_KEYS)})")
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise ValueError(f"--tenant-rate-limit-config: {name}.{key} must be a number > 0, got {value!r}")
        return cls(entries["default"], tenants)

    def label(self, tenant: str) -> str:
        """The tenant's name in metrics: a configured tenant by name, any other as ``default`` (the
        names come from clients: unbounded)."""
        return tenant if tenant in self.configured else "default"

    def _limits(self, tenant: str) -> TenantLimits:
        got = self.limits.get(tenant)
        if got is None:
            spec = {**self.default, **self.configured.get(tenant, {})}
            got = TenantLimits()
            for rate_key, burst_key, attr in (("requests_per_second", "request_burst", "requests"),
                                              ("tokens_per_second", "token_burst", "tokens")):
                if rate_key in spec:
                    rate = float(spec[rate_key])
                    bucket = Bucket(rate, float(spec.get(burst_key, max(rate, 1.0))))
                    setattr(got, attr, bucket)
                    got.buckets.append(bucket)
            self.limits[tenant] = got
        return got

    def admit(self, tenant: str, cost: float, now: float) -> int | None:
        """Take one request of ``cost`` tokens from ``tenant``'s buckets, or, when they lack it,
        take nothing and return the whole seconds to wait (``Retry-After``, at least 1)."""
        lim = self._limits(tenant)
        if not lim.buckets:
            return None
        for b in lim.buckets:
            b.refill(now)
        wait = max(lim.requests.wait_for(1.0) if lim.requests else 0.0,
                   lim.tokens.wait_for(cost) if lim.tokens else 0.0)
        if wait > 0:
            return max(1, math.ceil(wait))
        if lim.requests:
            lim.requests.level -= 1.0
        if lim.tokens:
            lim.tokens.level -= min(cost, lim.tokens.burst)
        return None
