"""``SchedParts``: the managers a scheduler is made of, and the ``BatchBuilder`` contract.

``build_parts`` makes each manager once, handing it its collaborators at construction (none is
attached later), in dependency order:

    Clock, Queues, SchedStats, SchedSettings ── shared state every manager reads
    ForwardThread ──────── the overlap loop's forwards, placeholders and held requests
    Outputs ────────────── tokens onto requests, stop checks, finishing (holds KV through ForwardThread)
    DeadlineAdmission ──── step-time measurements and the TTFT prediction
    GrammarQueue, Intake ─ validation, priority, deadline admission, queue cap, aborts, timeouts
    Ordering ───────────── the policy's order, aging, returned victims, queue-aware eviction marks
    Preemption ─────────── priority preemption, preemption by recompute, decode retraction
    Speculation ────────── draft tokens and what the target accepted (only with --speculative-algorithm)
    KVManager ──────────── (given) the one door to KV memory

A ``BatchBuilder`` turns them into each step's batch: ``scheduler.PrefillFirst`` (SGLang's prefill
then decode) or ``unified_scheduler.TokenBudget`` (vLLM's one token budget). ``SchedulerCore``
runs the loop around whichever it is given.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.config import ServerArgs
from radixserve.config.speculative import DRAFT_MODEL_ALGORITHMS
from radixserve.mem.forward_batch import Runner
from radixserve.sched.deadline import DeadlineAdmission
from radixserve.sched.grammar_queue import Compiler, GrammarQueue
from radixserve.sched.intake import Intake
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.ordering import Ordering, ReturnedVictims
from radixserve.sched.output import Outputs
from radixserve.sched.overlap import ForwardThread
from radixserve.sched.preemption import Preemption
from radixserve.sched.req import Req
from radixserve.sched.schedule_batch import ScheduleBatch
from radixserve.sched.settings import SchedSettings
from radixserve.sched.spec import Speculation
from radixserve.sched.state import Clock, Queues
from radixserve.sched.stats import SchedStats


@dataclass(frozen=True)
class SchedParts:
    settings: SchedSettings
    clock: Clock
    queues: Queues
    stats: SchedStats
    kv: KVManager
    runner: Runner
    forward: ForwardThread
    outputs: Outputs
    deadlines: DeadlineAdmission
    grammars: GrammarQueue
    intake: Intake
    victims: ReturnedVictims
    ordering: Ordering
    preemption: Preemption
    spec: Speculation | None = None  # speculative decoding's drafts (--speculative-algorithm)

    def admit(self, req: Req) -> None:
        """Give ``req`` its request slot and cached prefix; the first time, count it as admitted."""
        self.kv.admit(req)
        if not req.admitted_before:
            self.stats.on_first_admission(req, self.clock(), self.settings.args.starvation_threshold)

    def held_slots(self) -> int:
        """Requests that ended but keep their request slot until the forward in flight is done."""
        return len(self.forward.held)


class BatchBuilder(Protocol):
    """One scheduling algorithm: what runs next, given the last step's batch."""

    def next_batch(self, last: ScheduleBatch | None) -> ScheduleBatch | None:
        """The next step's batch (its KV slots taken), or None when nothing can run."""

    def busy(self, last: ScheduleBatch | None) -> bool:
        """Work of the builder's own beyond the queues (a prefill not merged into the running batch)."""

    def may_build_ahead(self) -> bool:
        """Whether the overlap loop may build the next step before the last decode step's results."""

    def on_idle(self) -> None:
        """The engine ran dry (reset estimates that only hold under load)."""


def build_parts(
    args: ServerArgs, runner: Runner, kv: KVManager, *, context_len: int, eos_token_ids: Sequence[int] = (), detokenize: Callable[[list[int]], str] | None = None,
    clock: Callable[[], float] | None = None, grammar_compiler: Compiler | None = None,
) -> SchedParts:
    """``grammar_compiler`` (``radixserve.grammar.GrammarCompiler``): builds the matchers of
    requests with a grammar; without one such requests are refused."""
    settings = SchedSettings(args)
    clk = Clock() if clock is None else Clock(clock)
    pool_reqs = kv.req_to_token_pool.size
    queues = Queues(min(args.max_running_requests or pool_reqs, pool_reqs))
    stats = SchedStats()
    forward = ForwardThread(runner, kv, clk)
    outputs = Outputs(kv, stats, queues.by_rid, clk, context_len, detokenize, hold=forward.hold)
    deadlines = DeadlineAdmission(settings, queues, kv, stats, clk)
    grammars = GrammarQueue(grammar_compiler, outputs.end)
    intake = Intake(settings, queues, kv, outputs, deadlines, clk, eos_token_ids=eos_token_ids, grammars=grammars)
    victims = ReturnedVictims()
    ordering = Ordering(settings, kv, victims, random.Random(args.random_seed))
    preemption = Preemption(settings, queues, kv, stats, outputs, ordering, victims, clk)
    spec = None
    algo = (args.speculative_algorithm or "").lower()
    if algo:
        spec = Speculation(args.speculative_num_draft_tokens, args.speculative_ngram_min_match_window_size,
                           args.speculative_ngram_max_match_window_size, args.speculative_max_batch_size,
                           by_runner=algo in DRAFT_MODEL_ALGORITHMS,
                           breadth=args.speculative_ngram_max_bfs_breadth if args.page_size == 1 else 1)
    return SchedParts(settings, clk, queues, stats, kv, runner, forward, outputs, deadlines, grammars, intake,
                      victims, ordering, preemption, spec)
