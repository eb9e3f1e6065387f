"""What the simulated fleet keeps: its engines, the requests in flight, the router replicas, and the
trace a run leaves (fleet.py runs the loop; fleet_report.py reads the trace)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.router.affinity import SessionAffinity
from radixserve.router.policy import RouterPolicy, Target
from radixserve.sched.core import SchedulerCore
from radixserve.sched.req import Req
from radixserve.sim.fleet_config import FleetConfig
from radixserve.sim.simulator import ReqRecord, SimRunner, VirtualClock


class Engine:
    """One simulated scheduler (a worker, or one DP rank of it) and what the fleet loop keeps of it."""

    def __init__(self, sched: SchedulerCore, runner: SimRunner, clock: VirtualClock, worker: int, rank: int,
                 target: Target) -> None:
        self.sched, self.runner, self.clock = sched, runner, clock
        self.worker, self.rank = worker, rank
        self.target = target  # the router target its requests are counted under
        self.pending: list[Req] = []  # routed here, not yet handed to the scheduler
        self.live: dict[str, Req] = {}
        self.scheduled = False  # a STEP event for it is in the heap
        self.steps = 0
        self.usage_sum = 0.0
        self.usage_max = 0.0
        self.max_running = 0
        self.max_waiting = 0


@dataclass
class Routed:
    """A request between its routing and its finish."""

    target: Target
    engine: Engine
    branch: str
    predicted: float | None  # the share of the prompt the router believed the target holds
    conversation: int  # closed loop: index into the fleet's conversation list


@dataclass
class FleetRecord:
    rid: str
    record: ReqRecord
    worker: int
    rank: int
    branch: str
    predicted: float | None


@dataclass
class FleetTrace:
    label: str
    config: FleetConfig
    records: list[FleetRecord] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    step_sched_s: list[float] = field(default_factory=list)
    step_sched_cpu_s: list[float] = field(default_factory=list)
    duration: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    cache_events: int = 0  # insert + evict events the router's tree received
    replica_agreement: float | None = None  # router_replicas > 1: share of requests all replicas routed alike


@dataclass
class Replica:
    """One router replica: its policy (its own tree), its own in-flight counts, its own sessions."""

    policy: RouterPolicy
    affinity: SessionAffinity | None
    targets: list[Target] = field(default_factory=list)
    by_key: dict[str, Target] = field(default_factory=dict)


def branch_counts(records: Sequence[FleetRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.branch for r in records).items()))
