"""Per-class counters (``sched/class_stats.py``): labels and their bound."""

from __future__ import annotations

from radixserve.sched.req import Req
from radixserve.sched.stats import ClassCounters
from tests.fakes import make_scheduler
from tests.sched.policy_helpers import prompt, submit


def _req(rid: str, priority: int | None, tenant: str | None) -> Req:
    r = Req(rid, [1, 2, 3], priority=priority)
    r.tenant = tenant
    return r


def test_labels_are_the_priority_sent_and_the_tenant() -> None:
    c = ClassCounters()
    c.add(_req("a", 3, "t1"), "preemptions")
    c.add(_req("b", 3, "t1"), "preemptions")
    c.add(_req("c", None, None), "retractions", 2)
    c.add(_req("d", -1, "t2"), "starved")
    assert c.rows() == [("", "", 0, 2, 0), ("-1", "t2", 0, 0, 1), ("3", "t1", 2, 0, 0)]
    assert c.get("3", "t1") == {"preemptions": 2, "retractions": 0, "starved": 0}


def test_tenants_past_the_bound_share_other() -> None:
    c = ClassCounters(max_tenants=2)
    for i, t in enumerate(["t1", "t2", "t3", "t4", "t1"]):
        c.add(_req(f"r{i}", 0, t), "starved")
    assert c.rows() == [("0", "other", 0, 0, 2), ("0", "t1", 0, 0, 2), ("0", "t2", 0, 0, 1)]


def test_defaulted_priority_keeps_the_label_of_none() -> None:
    """With priority scheduling on, a request without a priority gets the default value; its label
    stays "" (what the HTTP process labels its histograms with)."""
    sched, _, _ = make_scheduler(enable_priority_scheduling=True, default_priority_value=7)
    r = submit(sched, "r", prompt(1, 4), 2)
    assert r.priority == 7 and sched.stats.by_class.key(r) == ("", "")
