"""The router's ``/dashboard/state``: its own queue next to each worker's ``/dashboard/state``.

The page (``radixserve/dashboard``) is the server's; given this answer it draws the router's queue
and one column per worker. Workers are asked in parallel, each with ``WORKER_TIMEOUT_S``, so a slow
or dead worker shows as an error in its column instead of stalling the page.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from radixserve.router.admission import NO_PRIORITY_RANK
from radixserve.router.router import Router

WORKER_TIMEOUT_S = 2.0


async def _worker_state(router: Router, url: str) -> dict[str, Any]:
    assert router.session is not None
    try:
        async with router.session.get(url + "/dashboard/state", headers=router.fleet.auth,
                                      timeout=aiohttp.ClientTimeout(total=WORKER_TIMEOUT_S)) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            return {"state": await r.json(content_type=None)}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


async def router_state(router: Router) -> dict[str, Any]:
    workers = router.fleet.describe()
    states = await asyncio.gather(*(_worker_state(router, w["url"]) for w in workers))
    adm = router.admission
    queue = adm.queue
    # the router's queue ranks are priorities turned into sort keys; show the priority back
    classes = [[None if rank == NO_PRIORITY_RANK else rank, tenant, n] for rank, tenant, n in queue.classes()]
    first: dict[str, Any] = next((s["state"] for s in states if "state" in s), {})
    return {
        "kind": "router",
        "time": time.time(),
        "routing_policy": router.policy.name,
        "schedule_policy": first.get("schedule_policy"),
        "policies": first.get("policies", []),
        "router": {"waiting": adm.waiting, "in_flight": adm.in_flight, "limit": queue.limit,
                   "queue_size": queue.queue_size, "rejected": adm.rejected, "timed_out": adm.timed_out,
                   "classes": classes},
        "workers": [{"url": w["url"], "role": w["role"], "healthy": w["healthy"], "in_flight": w["load"], **s}
                    for w, s in zip(workers, states, strict=True)],
    }
