"""Who may call what: ``--api-key`` and ``--admin-api-key``, one rule for a server and a router.

    /health, the dashboard's page and static files   -> open (they hold no data)
    an admin route, --admin-api-key set              -> the admin key only (--api-key is not enough)
    any other route, --api-key set                   -> --api-key or the admin key
    otherwise                                        -> open

Without ``--admin-api-key`` the admin routes are ordinary routes (``--api-key`` guards them like the
rest). The key comes as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``, and is compared in
constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from radixserve import dashboard

# the server's admin routes (any method); the router adds its worker management
SERVER_ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/set_schedule_policy"})

WRONG_KEY = "Incorrect API key provided."
NEEDS_ADMIN = "This endpoint is an admin endpoint: it needs the admin API key (--admin-api-key)."


def server_admin_route(method: str, path: str) -> bool:
    return path in SERVER_ADMIN_PATHS


@dataclass(frozen=True)
class Access:
    api_key: str | None
    admin_api_key: str | None = None
    is_admin: Callable[[str, str], bool] = server_admin_route  # (method, path) -> an admin route?

    def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        """None when the request may go on, else the message of its 401. ``headers``: lower-case names."""
        if path == "/health" or dashboard.is_public(path):
            return None
        key = presented_key(headers)
        if self.admin_api_key and self.is_admin(method, path):
            return None if _same(key, self.admin_api_key) else NEEDS_ADMIN
        if not self.api_key or _same(key, self.api_key) or (self.admin_api_key and _same(key, self.admin_api_key)):
            return None
        return WRONG_KEY


def presented_key(headers: Mapping[str, str]) -> str:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
