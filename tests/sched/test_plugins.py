"""The policy plugin interface and live switching (sched/policies/registry.py, sched/settings.py, examples/policies/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import radixserve.sched.policies.registry as policy_mod
from radixserve.config import ServerArgs
from radixserve.sched.policies import PolicyContext, SchedulePolicy, policy_names
from radixserve.sched.policies import registry as plugins
from radixserve.sched.req import Req
from tests.fakes import drain, expected_tokens, make_scheduler
from tests.sched.policy_helpers import prompt, submit

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "policies" / "oldest_first.py")


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Plugins register globally: leave the registry as the other tests expect it."""
    saved, files = dict(policy_mod._REGISTRY), set(plugins._loaded_files)
    yield
    policy_mod._REGISTRY.clear()
    policy_mod._REGISTRY.update(saved)
    plugins._loaded_files.clear()
    plugins._loaded_files.update(files)


class NewestFirst(SchedulePolicy):
    """Importable as tests.sched.test_plugins:NewestFirst; not registered."""

    name = "newest-first"

    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(waiting, key=lambda r: -r.arrival_time)


def _admissions(sched, reqs):  # type: ignore[no-untyped-def]
    order: list[str] = []
    while sched.has_work():
        sched.step()
        order += [r.rid for r in reqs if r.first_scheduled_time is not None and r.rid not in order]
    drain(sched)
    for r in reqs:
        assert r.output_ids == expected_tokens(r.origin_input_ids, r.max_new_tokens), r.rid
    return order


def test_plugin_file_loads_and_orders() -> None:
    sched, _, _ = make_scheduler(policy_plugin=EXAMPLE, schedule_policy="oldest-first", prefill_max_requests=1)
    assert "oldest-first" in policy_names() and sched.settings.policy.name == "oldest-first"
    reqs = [submit(sched, f"r{i}", prompt(i, 6), 2, arrival=float(10 - i)) for i in range(4)]
    assert _admissions(sched, reqs) == ["r3", "r2", "r1", "r0"]


def test_module_class_spec_loads() -> None:
    sched, _, _ = make_scheduler(schedule_policy="tests.sched.test_plugins:NewestFirst", prefill_max_requests=1)
    reqs = [submit(sched, f"r{i}", prompt(20 + i, 6), 2, arrival=float(i)) for i in range(3)]
    assert _admissions(sched, reqs) == ["r2", "r1", "r0"]


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        ServerArgs(schedule_policy="nope")
    with pytest.raises(ValueError, match="cannot load"):
        make_scheduler(schedule_policy="tests.sched.nothing_here:X")
    with pytest.raises(ValueError, match="no such file"):
        make_scheduler(policy_plugin="/nonexistent/policy.py", schedule_policy="x")


def test_live_switch_keeps_the_queue() -> None:
    sched, _, kv = make_scheduler(prefill_max_requests=1, max_running_requests=1)
    reqs = [submit(sched, f"r{i}", prompt(40 + i, 6), 3, arrival=float(i)) for i in range(5)]
    sched.step()  # r0 admitted (fcfs)
    queue = list(sched.queues.waiting)
    res = sched.set_schedule_policy({"schedule_policy": "tests.sched.test_plugins:NewestFirst"})
    assert res["success"] and res["schedule_policy"] == "tests.sched.test_plugins:NewestFirst"
    assert sched.queues.waiting == queue and reqs[0].admitted_before and reqs[0] not in queue
    order = _admissions(sched, reqs)
    assert order == ["r0", "r4", "r3", "r2", "r1"]
    kv.check_invariant()


def test_live_switch_params_and_errors() -> None:
    sched, _, _ = make_scheduler(policy_plugin=EXAMPLE)
    r = submit(sched, "a", prompt(60, 6), 2)
    res = sched.set_schedule_policy({"schedule_policy": "oldest-first", "per_tenant": 2,
                                     "priority_aging_horizon": 3.0})
    assert res["success"], res
    assert sched.settings.policy.per_tenant == 2 and sched.settings.args.priority_aging_horizon == 3.0  # type: ignore[attr-defined]
    before = sched.settings.policy
    for bad in ({"schedule_policy": "nope"}, {"schedule_policy": "fcfs", "per_tenant": 1},
                {"priority_aging_horizon": -1}, {"schedule_policy": "vtc", "tenant_weights": "a=x"}):
        res = sched.set_schedule_policy(bad)
        assert not res["success"] and res["message"], bad
        assert sched.settings.policy is before  # nothing changed
    res = sched.set_schedule_policy({"schedule_policy": "vtc", "tenant_weights": "a=2"})
    assert res["success"] and sched.settings.policy.weights == {"a": 2.0}  # type: ignore[attr-defined]
    assert sched.queues.waiting == [r]
    drain(sched)
    assert r.output_ids == expected_tokens(r.origin_input_ids, 2)
