"""Worker lifecycle at the router (``router/lifecycle.py``): stalled and wedged workers get no new
traffic and come back, a joining worker's share grows over its warm-up; and a router in front of
stub workers leaving a wedged one alone while its request finishes."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from radixserve.router.lifecycle import Lifecycle
from tests.router.router_helpers import Fleet, post, run


def test_stalled_until_contact_resumes() -> None:
    lc = Lifecycle(stall_secs=3.0)
    lc.contact("w", 0.0)
    assert lc.state("w", 0, 2.0) == "ok" and lc.state("w", 0, 3.5) == "stalled"
    lc.contact("w", 4.0)
    assert lc.admits("w", 0, 4.1)


def test_wedged_while_in_flight_and_frozen() -> None:
    lc = Lifecycle(wedge_secs=3.0)
    lc.steps("w", 10, 0.0)
    assert lc.state("w", 2, 2.0) == "ok"
    assert lc.state("w", 2, 3.5) == "wedged"  # requests in flight, no step for 3.5 s
    lc.steps("w", 10, 4.0)
    assert lc.state("w", 2, 4.0) == "wedged"  # the same count: still no step
    lc.steps("w", 11, 5.0)
    assert lc.state("w", 2, 5.0) == "ok"  # it moves again
    assert lc.state("w", 0, 20.0) == "ok"  # nothing in flight: an idle engine runs no steps
    assert lc.state("w", 1, 21.0) == "ok"  # (and the wait starts over from there)


def test_a_joining_worker_warms_up() -> None:
    lc = Lifecycle(warmup_secs=10.0, seed=1)
    assert lc.admits("first", 0, 0.0)  # the router's own start: warm
    lc.joined("new", 100.0)
    share = sum(lc.admits("new", 0, 102.0) for _ in range(2000)) / 2000
    assert 0.15 < share < 0.25  # 2 s of 10
    share = sum(lc.admits("new", 0, 108.0) for _ in range(2000)) / 2000
    assert 0.75 < share < 0.85
    assert all(lc.admits("new", 0, 110.0) for _ in range(100))


def test_a_wedged_worker_is_left_alone_until_it_moves() -> None:
    async def scenario(fleet: Fleet, client: aiohttp.ClientSession) -> None:
        slow = await fleet.stub(delay_ms=4000)  # its engine "hangs": answers late, steps never move
        fast = await fleet.stub()
        router = await fleet.start_router([slow, fast], policy="round_robin", worker_wedge_secs=0.5)
        pair = [asyncio.create_task(post(client, f"{fleet.url}/generate", {"text": t})) for t in "ab"]
        done, (stuck,) = await asyncio.wait(pair, return_when=asyncio.FIRST_COMPLETED)  # round robin: one each
        assert [d.result()[0] for d in done] == [200]
        lifecycle = router.fleet.lifecycle
        assert lifecycle is not None
        for _ in range(40):  # the load loop reads /get_load every second
            if lifecycle.state(slow, router.workers[slow].load, time.monotonic()) == "wedged":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the slow worker was never found wedged")
        workers = {(await post(client, f"{fleet.url}/generate", {"text": f"c{i}"}))[1]["worker"] for i in range(4)}
        assert workers == {int(fast.rsplit(":", 1)[1])}  # no new traffic to the wedged one
        assert (await stuck)[0] == 200  # what it had finished
        both = {(await post(client, f"{fleet.url}/generate", {"text": f"d{i}"}))[1]["worker"] for i in range(2)}
        assert len(both) == 2  # nothing of ours in flight on it: back

    run(scenario)
