"""A simulated fleet: the router's policy objects in front of N simulated engines, one virtual timeline.

    request ──> RouterPolicy.select(targets) ──> worker w ──> its DP controller: rank (round robin)
                                            └──> rank (w, r) directly with --dp-aware

Every engine (a worker, or one data-parallel rank of it) is ``build_sim_scheduler``'s real
scheduler + radix cache with a ``VirtualClock`` of its own: the time its next step may start (its
"busy until"). One event heap orders three kinds of events by virtual time, ties in this order:

- ``FINISH``: a request ended at the end of the step that produced it. The router's load of its
  target drops by one; a closed-loop client (``concurrency``) sends its next request.
- ``ARRIVAL``: the policy picks a target from the loads of that moment; the load rises by one. The
  request waits at its engine until the engine's next step starts.
- ``STEP``: the engine whose next step starts earliest runs it (``sched.step()``; its clock moves
  by the cost model's step time). An idle engine steps when a request reaches it.

The router's own queue (``router_max_concurrent`` > 0): at most that many requests in flight
fleet-wide, the rest wait in the router's ``AdmissionQueue`` (the HTTP router's own code), in
priority order (``router_priority``) and VTC order over tenants (``router_tenant_fairness``), and
are routed when a request finishes; past ``router_queue_size`` waiting, a request is refused
(branch ``router_queue_full``). Time spent in the router's queue counts in TTFT.

``deadline_aware`` reads each target's waiting prompt tokens and measured prefill speed straight
from its engines at every decision (the HTTP router reads ``/get_load`` once a second); a request
it refuses never reaches an engine and is recorded as aborted (branch ``deadline_refused``).

Router replicas (``router_replicas`` R > 1): R policy objects, each with its own tree and its own
in-flight counts (fleet_state.Replica); arrivals go to them in turn and every cache event reaches all
of them. After a replica routes a request, the others are asked what they would have chosen
(``CacheAware.choose``, which records nothing); the share that agree is ``replica_agreement``.

An engine only ever sees its own requests, and a step is processed at its start with everything
that arrived up to then, so one engine behaves exactly as in ``simulator.run`` (a test holds them
equal). The router's load is its in-flight count per target (what sgl-router counts); the workers'
own ``/get_load`` reports are not modelled, because in a simulation they equal the router's count.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

from radixserve.config import ServerArgs
from radixserve.mem.cache_events import CacheEvent
from radixserve.options import parse_tenant_weights
from radixserve.router.admission import NO_PRIORITY_RANK, AdmissionQueue, TenantCounters
from radixserve.router.affinity import SessionAffinity, decide
from radixserve.router.policy import (
    CacheAware,
    NoTargetMeetsDeadline,
    RouteRequest,
    RouterPolicy,
    Target,
    make_router_policy,
)
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req
from radixserve.sim.cost_model import CostModel
from radixserve.sim.fleet_config import FleetConfig, chars_key
from radixserve.sim.fleet_state import Engine, FleetRecord, FleetTrace, Replica, Routed
from radixserve.sim.simulator import _record, build_sim_scheduler, make_req, submit
from radixserve.sim.workload import RequestSpec

FINISH, ARRIVAL, STEP = 0, 1, 2


class Fleet:
    def __init__(self, args: ServerArgs, cost: CostModel, context_len: int, cfg: FleetConfig,
                 skip_req_to_token_writes: bool = False, stream: bool = False) -> None:
        self.cfg = cfg
        self.stream = stream
        # as the HTTP router: a tree that follows the real caches picks a cache miss's target by load
        pcfg = dataclasses.replace(cfg.policy_config, miss_by_load=True) if cfg.cache_events else cfg.policy_config
        pc = cfg.policy_config  # session affinity keyed by conversation, as the router keys it by a header
        self.replicas = [Replica(make_router_policy(cfg.policy, pcfg),
                                 SessionAffinity(1800.0, pc.balance_abs_threshold, pc.balance_rel_threshold)
                                 if cfg.session_affinity else None) for _ in range(cfg.router_replicas)]
        self.policy: RouterPolicy = self.replicas[0].policy
        self.uses_key = self.policy.uses_tree
        if cfg.router_replicas > 1 and not isinstance(self.policy, CacheAware):
            raise ValueError(f"router_replicas: {cfg.policy} keeps no tree whose decisions could be compared")
        self.arrivals = 0
        self.compared = 0  # requests routed while there were replicas to compare with
        self.agreed = 0  # of those, the ones every other replica would have routed alike
        self.engines: list[Engine] = []
        self.targets: list[Target] = []  # the first replica's (each replica counts its own loads)
        self.by_target: dict[str, list[Engine]] = {}
        for w in range(cfg.num_workers):
            ranks = [Target(f"w{w}", dp_rank=r) for r in range(cfg.dp_size)] if cfg.dp_aware else [Target(f"w{w}")]
            for rep in self.replicas:
                mine = [Target(t.url, t.dp_rank) for t in ranks]
                rep.targets.extend(mine)
                rep.by_key.update((t.key, t) for t in mine)
            ranks = self.replicas[0].targets[-len(ranks):]
            for r in range(cfg.dp_size):
                target = ranks[r] if cfg.dp_aware else ranks[0]
                sink = self._sink(target.key) if cfg.cache_events else None
                sched, runner, clock = build_sim_scheduler(args, cost, context_len,
                                                           skip_req_to_token_writes=skip_req_to_token_writes,
                                                           event_sink=sink)
                eng = Engine(sched, runner, clock, w, r, target)
                self.engines.append(eng)
                self.by_target.setdefault(target.key, []).append(eng)
        self.targets = self.replicas[0].targets
        self.next_rank = dict.fromkeys(self.by_target, 0)  # a worker's DP controller: round robin
        self.routed: dict[str, Routed] = {}
        self.convs: list[list[RequestSpec]] = []  # closed loop: the conversations, in the order clients take them
        self.turn_of: dict[int, int] = {}  # closed loop: conversation -> its next turn
        self.next_conv = 0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.events = 0
        self.reports = cfg.policy == "deadline_aware"
        self.refused: list[FleetRecord] = []  # refused at the router (deadline_aware, its queue full)
        tenants = TenantCounters(dict(parse_tenant_weights(args.tenant_weights))) if cfg.router_tenant_fairness else None
        self.queue: AdmissionQueue[tuple[Req, RequestSpec, int]] = AdmissionQueue(
            cfg.router_max_concurrent, cfg.router_queue_size, tenants)
        self.low_first = args.schedule_low_priority_values_first

    def _key(self, ids: Sequence[int]) -> Sequence[Any]:
        return chars_key(ids) if self.cfg.match == "chars" else ids

    def _sink(self, target_key: str) -> Callable[[CacheEvent], None] | None:
        """The radix cache's event hook: every replica's tree receives every event."""
        from radixserve.sim.fleet_events import event_sink

        sinks = [event_sink(target_key, rep.policy, self._key, lambda: None) for rep in self.replicas]
        live = [f for f in sinks if f is not None]
        if not live:
            return None

        def sink(ev: CacheEvent) -> None:
            self._count_event()
            for f in live:
                f(ev)

        return sink

    def _count_event(self) -> None:
        self.events += 1

    def _push(self, t: float, kind: int, item: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, item))

    # --- events ------------------------------------------------------------------------------------
    def _arrive(self, t: float, spec: RequestSpec, conversation: int) -> None:
        req = make_req(spec, self.stream)
        verdict = self.queue.admit((req, spec, conversation), *self._queue_order(spec))
        if verdict == "queued":
            return  # routed when a slot frees (_finish)
        if verdict == "rejected":
            self._refuse(t, req, conversation, "router_queue_full", "the router's queue is full")
            return
        if not self._dispatch(t, req, spec, conversation):
            self._release(t)

    def _queue_order(self, spec: RequestSpec) -> tuple[int, str, float]:
        """As the HTTP router's ``queue_order``: (priority rank, tenant, cost in tokens)."""
        cfg = self.cfg
        rank = 0
        if cfg.router_priority:
            p = spec.priority
            rank = NO_PRIORITY_RANK if p is None else (p if self.low_first else -p)
        tenant = (spec.tenant or "") if cfg.router_tenant_fairness else ""
        return rank, tenant, float(spec.prompt_len + spec.output_len)

    def _refuse(self, t: float, req: Req, conversation: int, branch: str, why: str) -> None:
        req.finished_reason = FINISH_ABORT(why, status_code=429, code=branch)
        req.finished_time = t
        self.refused.append(FleetRecord(req.rid, _record(req), -1, -1, branch, None))
        if conversation >= 0:
            self._client_next(t, conversation)

    def _finish(self, t: float, rid: str) -> None:
        """A request ended: its target's load drops, its router slot goes to the next waiter."""
        r = self.routed.pop(rid)
        r.target.load -= 1
        if r.conversation >= 0:
            self._client_next(t, r.conversation)
        self._release(t)

    def _release(self, t: float) -> None:
        """A router slot is free: the next waiter in the queue's order takes it and is routed."""
        nxt = self.queue.release()
        while nxt is not None and not self._dispatch(t, *nxt):
            nxt = self.queue.release()

    def _dispatch(self, t: float, req: Req, spec: RequestSpec, conversation: int) -> bool:
        """Route ``req`` (it holds a router slot); False if the policy refused it (slot released
        by the caller)."""
        ids = req.origin_input_ids
        chars = self.uses_key and self.cfg.match == "chars"  # the text is only built for a policy that reads it
        route = RouteRequest(text=chars_key(ids)) if chars else RouteRequest(tokens=ids)
        route.deadline_ms = spec.deadline_ms
        if self.reports:
            self._report_loads()
        session = f"c:{spec.conversation}" if spec.conversation is not None else None
        rep = self.replicas[self.arrivals % len(self.replicas)]  # the replica the request reached, in turn
        self.arrivals += 1
        try:
            d = decide(rep.policy, rep.affinity, rep.targets, route, session, t)
        except NoTargetMeetsDeadline as e:  # refused at the router: it never reaches an engine
            self._refuse(t, req, conversation, "deadline_refused", str(e))
            return False
        if len(self.replicas) > 1:
            self._compare(rep, route, d.target.key)
        d.target.load += 1
        ranks = self.by_target[d.target.key]
        i = self.next_rank[d.target.key]
        self.next_rank[d.target.key] = (i + 1) % len(ranks)
        eng = ranks[i]
        key = route.key
        predicted = (d.matched / len(key) if len(key) else 0.0) if self.uses_key else None
        self.routed[req.rid] = Routed(d.target, eng, d.branch, predicted, conversation)
        eng.pending.append(req)
        eng.runner.expect(spec)
        if not eng.scheduled:
            eng.scheduled = True
            self._push(max(t, eng.clock.now), STEP, eng)
        return True

    def _compare(self, rep: Replica, route: RouteRequest, chosen: str) -> None:
        """Would every other replica have routed this request to ``chosen``, as ``rep`` did? Each
        decides from its own tree (the shared events plus its own routed paths) and its own
        in-flight counts, without recording anything."""
        self.compared += 1
        try:
            self.agreed += all(isinstance(o.policy, CacheAware) and o.policy.choose(o.targets, route).target.key == chosen
                               for o in self.replicas if o is not rep)
        except NoTargetMeetsDeadline:  # another replica would have refused it
            pass

    def _report_loads(self) -> None:
        """What the workers' /get_load says (deadline_aware): each target's waiting prompt tokens and
        its ranks' measured prefill speed. Read at every routing decision: fresher than the HTTP
        router's one-second reports."""
        for key, engines in self.by_target.items():
            waiting = sum(int(e.sched.get_load()["num_waiting_tokens"]) for e in engines) + \
                sum(len(r.origin_input_ids) for e in engines for r in e.pending)
            speed = sum(e.sched.deadlines.throughput.tokens_per_s for e in engines)
            for rep in self.replicas:  # every replica reads the same report
                target = rep.by_key[key]
                target.waiting_tokens, target.prefill_tokens_per_s, target.sent_tokens = waiting, speed, 0

    def _step(self, t: float, eng: Engine, trace: FleetTrace) -> None:
        eng.scheduled = False
        sched, clock, runner = eng.sched, eng.clock, eng.runner
        clock.now = max(clock.now, t)  # an idle engine jumps to the arrival that woke it
        for req in eng.pending:
            eng.live[req.rid] = req
            submit(sched, req)
        eng.pending = []
        fwd0, fwd_cpu0 = runner.wall, runner.cpu
        t0, c0 = time.perf_counter(), time.process_time()
        outs = sched.step()
        if sched.cur_batch is not None:
            trace.step_sched_s.append(time.perf_counter() - t0 - (runner.wall - fwd0))
            trace.step_sched_cpu_s.append(time.process_time() - c0 - (runner.cpu - fwd_cpu0))
            usage = sched.kv.usage()
            eng.steps += 1
            eng.usage_sum += usage
            eng.usage_max = max(eng.usage_max, usage)
            eng.max_running = max(eng.max_running, len(sched.queues.running.reqs))
            eng.max_waiting = max(eng.max_waiting, len(sched.queues.waiting))
        for rid, reason in zip(outs.rids, outs.finished_reasons, strict=True):
            if reason is None or rid not in eng.live:
                continue
            eng.runner.forget(rid)
            req = eng.live.pop(rid)
            r = self.routed[rid]
            trace.records.append(FleetRecord(rid, _record(req), eng.worker, eng.rank, r.branch, r.predicted))
            self._push(clock.now, FINISH, rid)
        # a step that scheduled nothing while work remains waits for the next request routed here, or
        # for the prefix it waits on to arrive from the host tier
        if sched.cur_batch is not None and sched.has_work():
            eng.scheduled = True
            self._push(clock.now, STEP, eng)
        elif (ready := sched.kv.next_load_time()) is not None:
            eng.scheduled = True
            self._push(ready, STEP, eng)

    # --- the loop ----------------------------------------------------------------------------------
    def run(self, specs: Sequence[RequestSpec], label: str = "", progress: bool = False) -> FleetTrace:
        trace = FleetTrace(label or self.cfg.policy, self.cfg, engines=self.engines)
        if self.cfg.concurrency:
            self.convs = _conversations(specs)
            self.next_conv = min(self.cfg.concurrency, len(self.convs))
            for c in range(self.next_conv):
                self.turn_of[c] = 0
                self._send(0.0, c)
        else:
            self.heap = [(s.arrival_time, ARRIVAL, i, (s, -1)) for i, s in enumerate(specs)]
            heapq.heapify(self.heap)
            self.seq = len(specs)
        total = len(specs)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"simulate {trace.label}", unit="req", mininterval=0.5)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        heap = self.heap
        while heap:
            t, kind, _, item = heapq.heappop(heap)
            if kind == STEP:
                self._step(t, item, trace)
            elif kind == ARRIVAL:
                self._arrive(t, item[0], item[1])
            else:
                self._finish(t, item)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        self._drain_check(trace)
        trace.records.extend(self.refused)
        trace.wall_s = time.perf_counter() - wall0
        trace.cpu_s = time.process_time() - cpu0
        trace.duration = max(e.clock.now for e in self.engines)
        trace.cache_events = self.events
        if len(self.replicas) > 1:
            trace.replica_agreement = self.agreed / self.compared if self.compared else None
        return trace

    def _client_next(self, t: float, c: int) -> None:
        """A closed-loop client's request in conversation ``c`` ended at ``t``: it sends the next
        turn at once (no think time), or starts the next conversation nobody has taken yet."""
        if self.turn_of[c] >= len(self.convs[c]):
            if self.next_conv >= len(self.convs):
                return
            c, self.next_conv = self.next_conv, self.next_conv + 1
            self.turn_of[c] = 0
        self._send(t, c)

    def _send(self, t: float, c: int) -> None:
        spec = self.convs[c][self.turn_of[c]]
        self.turn_of[c] += 1
        self._push(t, ARRIVAL, (dataclasses.replace(spec, arrival_time=t), c))

    def _drain_check(self, trace: FleetTrace) -> None:
        """Every request finished, every load is back to 0, every engine's memory adds up."""
        for eng in self.engines:
            if eng.sched.has_work() or eng.pending or eng.live:
                raise RuntimeError(f"engine w{eng.worker} rank {eng.rank} has work but schedules nothing "
                                   f"({len(eng.sched.queues.waiting)} waiting)")
            eng.sched.step()  # the idle step (the scheduler's own self-check with --idle-self-check)
            eng.sched.kv.check_invariant()
        leaked = {t.key: t.load for rep in self.replicas for t in rep.targets if t.load}
        if self.queue.waiting or self.queue.in_flight:
            raise RuntimeError(f"router queue left over: {self.queue.waiting} waiting, {self.queue.in_flight} slots held")
        if leaked or self.routed:
            raise RuntimeError(f"router loads left over: {leaked}, {len(self.routed)} requests unfinished")


def _conversations(specs: Sequence[RequestSpec]) -> list[list[RequestSpec]]:
    """The requests grouped by conversation (turns in order), conversations by first arrival; a
    request without a conversation is one of its own."""
    groups: dict[Any, list[RequestSpec]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(("c", s.conversation) if s.conversation is not None else ("r", i), []).append(s)
    return [sorted(g, key=lambda s: s.turn) for g in groups.values()]


def run_fleet(args: ServerArgs, specs: Sequence[RequestSpec], cost: CostModel, context_len: int,
              cfg: FleetConfig, label: str = "", progress: bool = False,
              skip_req_to_token_writes: bool = False, stream: bool = False) -> FleetTrace:
    fleet = Fleet(args, cost, context_len, cfg, skip_req_to_token_writes, stream)
    return fleet.run(specs, label, progress)
