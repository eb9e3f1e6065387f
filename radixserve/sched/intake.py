"""``Intake``: how requests enter the waiting queue and how they leave it before they run.

- ``add``: the checks of the scheduler's live state: a duplicate id, the priority checks under the
  live settings, ``--deadline-admission`` (``DeadlineAdmission``), then the queue cap. A request
  that cannot run is finished at once with an abort that says why. Whether a request can run on
  this engine at all (its prompt, its output budget against the context and the KV pool) was
  checked where it entered (``request_checks.py``).
- ``--max-queued-requests``: a full queue refuses a newcomer (429), unless priority scheduling is
  on and the newcomer is strictly more important than the least important queued request (the
  latest queued among equals): that one is aborted (429) and the newcomer queued.
- Without priority scheduling a priority is accepted and ignored, or refused (400) with
  ``--abort-on-priority-when-disabled``.
- a request with a grammar waits in the ``GrammarQueue`` until it is compiled, then joins the
  waiting queue (``poll``, each step); it counts against ``--max-queued-requests``.
- with a KV tier (``--enable-hierarchical-cache``), a request whose prefix the tier holds waits for
  it to load (``KVManager.prefetch``), then joins the waiting queue (``poll``, each step); it
  counts against ``--max-queued-requests`` too. A queued request near the head whose cached prefix
  was evicted meanwhile leaves the queue for such a load (``KVManager.recheck_tier``).
- ``abort``: a waiting request is finished at once; a running or chunked one is flagged and
  released at the start of the next step (``apply_aborts``), wherever it is by then.
- ``--queue-timeout``: a request not scheduled within that many seconds of queueing is aborted
  (503, code ``queue_timeout``); a preempted or retracted one (already partly served) is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixserve.sched.deadline import DeadlineAdmission
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.grammar_queue import GrammarQueue
from radixserve.sched.kv_manager import KVManager
from radixserve.sched.output import Outputs
from radixserve.sched.req import Req
from radixserve.sched.settings import SchedSettings
from radixserve.sched.state import Queues


class Intake:
    def __init__(
        self, settings: SchedSettings, queues: Queues, kv: KVManager, outputs: Outputs, deadlines: DeadlineAdmission,
        clock: Callable[[], float], *, eos_token_ids: Sequence[int],
        grammars: GrammarQueue | None = None,
    ) -> None:
        self.settings = settings
        self.queues = queues
        self.kv = kv
        self.outputs = outputs
        self.deadlines = deadlines
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.flagged: dict[Req, None] = {}  # running requests ``abort`` flagged, in order
        self.grammars = grammars if grammars is not None else GrammarQueue(None, outputs.end)

    # --- arrival -------------------------------------------------------------------------------
    def add(self, req: Req) -> bool:
        """Queue ``req``, or finish it at once with the abort that says why it cannot run."""
        if not req.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        reason = self.validate(req)
        if reason is not None:
            self.outputs.finish(req, reason)
            return False
        self.queues.by_rid[req.rid] = req
        req.queue_entry_time = self.clock()
        if self.grammars.park(req):  # waits for its grammar (or ended: no grammar engine here)
            return not req.finished()
        if not self.kv.prefetch(req):  # else it waits for its prefix to load from the KV tier
            self.queues.waiting.append(req)
        return True

    def poll(self) -> None:
        """Move the requests whose grammar is compiled, or whose prefix is loaded, to the waiting queue."""
        if self.grammars.pending:
            self.queues.waiting.extend(self.grammars.poll())
        if self.kv.tier is not None:
            self.queues.waiting.extend(self.kv.poll_loads())
            for req in self.kv.recheck_tier(self.queues.waiting):  # their prefix left the pool meanwhile
                self.queues.waiting.remove(req)

    def validate(self, req: Req) -> FINISH_ABORT | None:
        if req.rid in self.queues.by_rid:
            return FINISH_ABORT(f"duplicate request id {req.rid!r}", param="rid")
        spec = req.sampling_params.grammar
        if spec is not None and self.settings.args.disaggregation_mode != "null":
            return FINISH_ABORT(f"{spec[0]}: structured output does not work with prefill/decode disaggregation "
                                "(the decode side would need the prefill side's grammar state)",
                                code="unsupported", param=spec[0])
        return self.check_priority(req) or self.deadlines.check(req) or self.check_queue_cap(req)

    def check_priority(self, req: Req) -> FINISH_ABORT | None:
        s = self.settings.prio
        if req.priority is not None and (isinstance(req.priority, bool) or not isinstance(req.priority, int)):
            return FINISH_ABORT(f"priority must be an integer, got {req.priority!r}", param="priority")
        if not s.enabled:
            if req.priority is not None and s.abort_when_disabled:
                how = ("--scheduling-policy priority" if self.settings.args.scheduler == "unified"
                       else "--enable-priority-scheduling")
                return FINISH_ABORT(
                    f"this server does not schedule by priority ({how} is off) and refuses requests that "
                    "carry one (--abort-on-priority-when-disabled); send the request without a priority",
                    status_code=400, code="priority_disabled", param="priority",
                )
            return None
        if req.priority is None:
            req.priority = s.default
        return None

    def check_queue_cap(self, req: Req) -> FINISH_ABORT | None:
        """Room in the waiting queue for ``req``: refuse it, or abort a less important queued one."""
        cap = self.settings.args.max_queued_requests
        queue = self.queues.waiting
        if cap is None or len(queue) + len(self.grammars) + self.kv.loads_pending() < cap:
            return None
        prio = self.settings.prio
        if prio.enabled and queue:
            i = prio.least_important(queue)
            victim = queue[i]
            if prio.rank(req) < prio.rank(victim):
                del queue[i]
                self.outputs.end(victim, FINISH_ABORT(
                    f"the request queue is full (max_queued_requests={cap}) and this request was the least "
                    f"important in it (priority {victim.priority}); a more important one (priority "
                    f"{req.priority}) took its place",
                    status_code=429, err_type="rate_limit_error", code="queue_full_preempted",
                ))
                return None
        return FINISH_ABORT(
            f"too many queued requests (max_queued_requests={cap}); retry later",
            status_code=429, err_type="rate_limit_error", code="queue_full",
        )

    # --- leaving before the end ----------------------------------------------------------------
    def abort(self, rid: str, message: str = "aborted by the client", status_code: int = 499) -> bool:
        req = self.queues.by_rid.get(rid)
        if req is None:
            return False
        reason = FINISH_ABORT(message, status_code=status_code, code="aborted")
        if self.grammars.remove(req) or self.kv.cancel_load(req):
            self.outputs.end(req, reason)
        elif req in self.queues.waiting:
            self.queues.waiting.remove(req)
            self.outputs.end(req, reason)
        else:
            req.to_abort = reason  # running or chunked: released at the start of the next step
            self.flagged[req] = None
        return True

    def apply_aborts(self) -> None:
        """Finish the requests ``abort`` flagged while they ran (only those: no pass over the
        running batch), wherever they are now: running, the chunked request, or back in the
        waiting queue after a retraction."""
        flagged = self.flagged
        if not flagged:
            return
        q = self.queues
        running = q.running.reqs
        for req in list(flagged):
            if req.finished_reason is None:
                if req is q.chunked:
                    q.chunked = None
                elif req in running:
                    running.remove(req)
                elif req in q.waiting:
                    q.waiting.remove(req)
                else:
                    continue  # not reachable from here yet: keep the flag
                self.outputs.end(req, req.to_abort)  # type: ignore[arg-type]
            del flagged[req]

    def abort_timed_out(self) -> None:
        """Abort the waiting requests never scheduled within ``--queue-timeout`` seconds."""
        timeout = self.settings.args.queue_timeout
        q = self.queues
        if timeout is None or not q.waiting:
            return
        now = self.clock()
        expired = [
            r for r in q.waiting
            if not r.admitted_before and r.queue_entry_time is not None and now - r.queue_entry_time > timeout
        ]
        if not expired:
            return
        gone = {id(r) for r in expired}
        q.waiting = [r for r in q.waiting if id(r) not in gone]
        for r in expired:
            self.outputs.end(r, FINISH_ABORT(
                f"the request waited {now - r.queue_entry_time:.1f}s to be scheduled "  # type: ignore[operator]
                f"(queue_timeout={timeout}s); the server is overloaded, retry later",
                status_code=503, err_type="server_error", code="queue_timeout",
            ))
