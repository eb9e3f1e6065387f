"""The quality-of-service area of ``ServerArgs``: aging, short-first, deadlines, tenant fairness,
thrash-free preemption, policy plugins (docs/qos.md), and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import option, parse_tenant_weights


@dataclass(frozen=True)
class QoSOptions:
    # --- aging, short-first, deadlines, tenant fairness, thrash-free preemption, plugins
    # (docs/qos.md). The defaults leave every one of them off.
    priority_aging_rate: float = option(
        0.0, "Priority units a waiting request gains per second of wait (any policy; 0: off).")
    priority_aging_horizon: float | None = option(
        None, "Seconds of wait after which a request goes ahead of the policy's order, oldest first.")
    sjf_output_weight: float = option(
        1.0, "sjf: job size = uncached prompt tokens + min(max_new_tokens, --clip-max-new-tokens) * this.")
    deadline_admission: bool = option(
        False, "Refuse (429, code deadline_unmeetable) a request whose TTFT deadline cannot be met given "
        "the queue ahead of it in deadline order.")
    deadline_prefill_tokens_per_s: float = option(
        4000.0, "Initial prefill throughput estimate (tokens/s) for --deadline-admission; then an EMA of "
        "measured prefill steps.")
    tpot_headroom: float = option(
        0.9, "TPOT deadlines: the running batch is capped so the modelled decode step stays under this fraction "
        "of the tightest TPOT deadline among running requests (the rest is left to interleaved prefill steps); "
        "with --deadline-admission a request whose TPOT cannot be met even alone is refused.")
    tenant_weights: str | None = option(
        None, "vtc: tenant weights, 'a=2,b=1' (unlisted tenants: 1).")
    vtc_input_weight: float = option(1.0, "vtc: counter charge per input token (w_p).")
    vtc_output_weight: float = option(2.0, "vtc: counter charge per output token (w_q).")
    max_preemptions_per_request: int = option(
        3, "A request is preempted or retracted at most this many times; then it is no victim (unless "
        "retraction has no other choice). Returned victims go first in their class. 0 turns the guard off "
        "(no cap; victims re-queued where the policy puts them, as SGLang does).")
    retract_victim_policy: str = option(
        "sglang", "Victim order of decode retraction: sglang (fewest outputs first) or min-recompute "
        "(least tokens to recompute first; returned victims go first in their class).",
        ("sglang", "min-recompute"))
    policy_plugin: str | None = option(
        None, "Python file(s), comma-separated, imported at start; their @register_policy classes become "
        "--schedule-policy names.")
    starvation_threshold: float = option(
        30.0, "Seconds of queueing past which a request counts as starved (metric).")

    def _qos_errors(self) -> list[str]:
        errors: list[str] = []
        for name in ("priority_aging_rate", "sjf_output_weight", "vtc_input_weight", "vtc_output_weight"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or v < 0:
                errors.append(f"{name} must be a number >= 0, got {v!r}")
        if self.priority_aging_horizon is not None and not self.priority_aging_horizon > 0:
            errors.append(f"priority_aging_horizon must be > 0 seconds, got {self.priority_aging_horizon!r}")
        if not self.deadline_prefill_tokens_per_s > 0:
            errors.append("deadline_prefill_tokens_per_s must be > 0")
        if not 0 < self.tpot_headroom <= 1:
            errors.append("tpot_headroom must be in (0, 1]")
        if not isinstance(self.max_preemptions_per_request, int) or self.max_preemptions_per_request < 0:
            errors.append("max_preemptions_per_request must be an integer >= 0")
        if not self.starvation_threshold > 0:
            errors.append("starvation_threshold must be > 0 seconds")
        if self.tenant_weights is not None:
            try:
                parse_tenant_weights(self.tenant_weights)
            except ValueError as e:
                errors.append(str(e))
        return errors
