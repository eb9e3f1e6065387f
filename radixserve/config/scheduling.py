"""The scheduling area of ``ServerArgs``: batch limits, chunked prefill, the retraction reserve,
the event loop, the waiting queue's policy and priorities, and vLLM's unified scheduler (SGLang's
option names for the default scheduler, vLLM's for ``--scheduler unified``; docs/scheduling.md)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import not_positive, option

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "sjf", "edf", "vtc")


@dataclass(frozen=True)
class SchedulingOptions:
    schedule_policy: str = option(
        "fcfs", f"Order of the waiting queue: one of {', '.join(SCHEDULE_POLICIES)}, a policy registered by "
        "--policy-plugin, or module.path:ClassName (docs/qos.md).")
    max_running_requests: int | None = option(
        None, "Most requests running at once, and the request slots the pool has (vLLM's "
        "--max-num-seqs is the same option). Default: 256.", aliases=("--max-num-seqs",))
    max_queued_requests: int | None = option(None, "Most requests waiting; past it new requests are rejected (429).")
    max_prefill_tokens: int = option(16384, "Most new prompt tokens in one prefill batch (rem_input_tokens).")
    prefill_max_requests: int | None = option(None, "Most requests admitted in one prefill batch.")
    chunked_prefill_size: int = option(
        2048, "Most prompt tokens of one request per prefill step (rem_chunk_tokens); -1 disables chunking."
    )
    enable_mixed_chunk: bool = option(
        False, "Run a prefill step's chunk and the running requests' decode in one forward (ForwardMode MIXED), "
        "so decodes do not wait out long prefills; the decodes take their tokens from the chunk budget.")
    enable_dynamic_chunking: bool = option(
        False, "Size each prefill chunk so the step stays near --dynamic-chunk-target-ms while requests decode: "
        "the measured prefill speed times the time left (the whole target, less a decode step when mixed), "
        "at most --chunked-prefill-size; without mixed chunks the running requests decode once after each "
        "prefill step. Without running requests the chunk is --chunked-prefill-size.")
    dynamic_chunk_target_ms: float = option(
        100.0, "With --enable-dynamic-chunking: the step time a prefill chunk should stay under while requests decode.")
    schedule_conservativeness: float = option(1.0, "Scales the reserve held for running requests' future tokens.")
    init_new_token_ratio: float = option(0.7, "Initial fraction of max_new_tokens reserved per running request.")
    min_new_token_ratio_factor: float = option(0.14, "new_token_ratio floor = init_new_token_ratio * this.")
    new_token_ratio_decay_steps: int = option(600, "Decode steps for new_token_ratio to decay from init to the floor.")
    retract_decode_steps: int = option(20, "Decode steps of headroom the survivors of a retraction must have.")
    clip_max_new_tokens: int = option(4096, "Cap on one request's max_new_tokens when reserving budget.")
    idle_self_check: bool = option(True, "Assert the KV memory invariant every time the engine goes idle.")
    overlap_schedule: str = option(
        "auto", "Event loop. on: the overlap loop (build step N+1 while step N's forward runs, then process "
        "step N's results); off: the normal loop (schedule the next step once this step's results are "
        "processed); outputs are the same. auto: off in the engine, whose CPU forward competes with the "
        "scheduler thread for the same cores (measured: batch-1 time per token 11 ms normal vs 20 ms "
        "overlap, concurrency 32 1.09x the throughput; docs/benchmarks.md); on in the simulator, which models a "
        "GPU server. Tensor parallelism and disaggregation always run the normal loop. SGLang's "
        "--disable-overlap-schedule is --overlap-schedule off.", ("auto", "on", "off"),
        switches={"--disable-overlap-schedule": "off"})

    # --- scheduling policies, priority, the unified scheduler (docs/scheduling.md) ---------------
    # SGLang's option names for the default scheduler, vLLM's for --scheduler unified.
    lpm_fallback_threshold: int = option(
        128, "lpm orders by cached prefix only while at most this many requests wait, else fcfs "
        "(SGLang hard-codes 128); 0 never falls back.")
    in_batch_prefix_caching_check_threshold: int = option(
        32, "lpm: a waiting request whose cached prefix is at most this long is checked against the "
        "prompts of the requests ahead of it this round (SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD).")
    in_batch_prefix_caching_deprioritize_threshold: int = option(
        32, "lpm: such a request sharing at least this many uncached tokens with one ahead of it goes to "
        "the back, to hit that one's cache later (SGLang's IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD); "
        "0 disables the check.")
    enable_priority_scheduling: bool = option(
        False, "Order the waiting queue by request priority first (then arrival) and let a request "
        "preempt running ones of much lower priority.")
    schedule_low_priority_values_first: bool = option(
        False, "With --enable-priority-scheduling: a smaller priority value is more important (default: larger).")
    priority_scheduling_preemption_threshold: int = option(
        10, "A waiting request preempts a running one only if its priority beats it by more than this.")
    abort_on_priority_when_disabled: bool = option(
        False, "Without priority scheduling, abort (400) a request that carries a priority instead of ignoring it.")
    default_priority_value: int | None = option(
        None, "Priority of a request that gives none (default: the least important value, as SGLang; "
        "0 under --scheduler unified, as vLLM).")
    queue_timeout: float | None = option(
        None, "Seconds a request may wait to be scheduled before it is aborted (503, code queue_timeout).")
    scheduler: str = option(
        "sglang", "sglang: prefill-first batches built by the PrefillAdder; unified: vLLM V1's token-budget "
        "scheduler (mixed prefill+decode steps, preemption by recompute).", ("sglang", "unified"))
    scheduling_policy: str = option(
        "fcfs", "--scheduler unified: waiting order and preemption victim; priority: smaller value first, "
        "victim the least important latest arrival (vLLM's --scheduling-policy).", ("fcfs", "priority"))
    max_num_batched_tokens: int = option(8192, "--scheduler unified: most tokens scheduled in one step.")
    long_prefill_token_threshold: int = option(
        0, "--scheduler unified: most prompt tokens of one request per step (0: no cap but the budget).")

    @property
    def chunk_size(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def _scheduling_errors(self) -> list[str]:
        errors: list[str] = []
        for name in ("max_running_requests", "max_queued_requests", "prefill_max_requests"):
            errors += not_positive(self, name)
        for name in ("max_prefill_tokens", "new_token_ratio_decay_steps", "clip_max_new_tokens",
                     "max_num_batched_tokens"):
            errors += not_positive(self, name, allow_none=False)
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size <= 0:
            errors.append("chunked_prefill_size must be positive or -1 (disabled)")
        if not 0.0 <= self.init_new_token_ratio <= 1.0:
            errors.append("init_new_token_ratio must be in [0, 1]")
        if self.retract_decode_steps < 0:
            errors.append("retract_decode_steps must be >= 0")
        if not self.dynamic_chunk_target_ms > 0:
            errors.append("dynamic_chunk_target_ms must be > 0")
        return errors + self._policy_errors()

    def _policy_errors(self) -> list[str]:
        """The waiting queue's policy, priorities, and which scheduler each option belongs to."""
        errors: list[str] = []
        for name in ("lpm_fallback_threshold", "in_batch_prefix_caching_check_threshold",
                     "in_batch_prefix_caching_deprioritize_threshold", "long_prefill_token_threshold"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                errors.append(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.priority_scheduling_preemption_threshold, int):
            errors.append("priority_scheduling_preemption_threshold must be an integer")
        if self.default_priority_value is not None and not isinstance(self.default_priority_value, int):
            errors.append("default_priority_value must be an integer")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            errors.append(f"queue_timeout must be > 0 seconds, got {self.queue_timeout!r}")
        if self.scheduler == "unified" and self.schedule_policy != "fcfs":
            errors.append("--schedule-policy orders the sglang scheduler's queue; --scheduler unified "
                          "takes --scheduling-policy fcfs|priority")
        if self.scheduler == "unified" and self.enable_priority_scheduling:
            errors.append("--enable-priority-scheduling is the sglang scheduler's; with --scheduler unified "
                          "use --scheduling-policy priority")
        if self.scheduler == "sglang" and self.scheduling_policy != "fcfs":
            errors.append("--scheduling-policy is the unified scheduler's (vLLM's); with --scheduler sglang "
                          "use --enable-priority-scheduling")
        return errors
