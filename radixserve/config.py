"""``ServerArgs``: every radixserve option, its default, its validation and its CLI flag.

One frozen dataclass (the quality-of-service options come from ``qos_options.QoSOptions``); the
CLI is generated from its fields (flag = ``--`` + field name with ``-``),
so ``--help`` and ``Engine(**kwargs)`` can never drift apart. "auto" values stay "auto" here and
are resolved by the component that owns them (e.g. the model runner picks the dtype).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from radixserve.options import add_dataclass_cli_args, dataclass_from_cli_args, option
from radixserve.qos_options import QoSOptions

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "sjf", "edf", "vtc")
RADIX_EVICTION_POLICIES = ("lru", "lfu", "queue-aware")


@dataclass(frozen=True)
class ServerArgs(QoSOptions):
    # --- model -------------------------------------------------------------------------------
    model_path: str | None = option(
        None, "Local GGUF file or safetensors directory (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Granite, OLMo 2, Gemma 2/3). "
        "Default: the bundled SmolLM2-135M-Instruct GGUF.", group="model"
    )
    served_model_name: str | None = option(None, "Model name reported by the API (default: derived from the path).", group="model")
    reasoning_parser: str | None = option(
        None, "Answer a reasoning model's thinking as reasoning_content, apart from content, in chat "
        "completions: qwen3 (the output opens <think> itself) or deepseek-r1 (the prompt opened it).",
        ("qwen3", "deepseek-r1"), group="model")
    tool_call_parser: str | None = option(
        None, "The format the model writes tool calls in, parsed out of chat answers (tool_choice auto): "
        "hermes (Qwen 2.5/3, Hermes), llama3, mistral, pythonic (Llama 3.2/4). tool_choice required or a "
        "named function works without it (hermes format).",
        ("hermes", "llama3", "mistral", "pythonic"), group="model")
    chat_template: str | None = option(
        None, "Chat template to use instead of the model's own: a Jinja file, or the template text itself "
        "(anything with {{ or {%%).", group="model")
    dtype: str = option("auto", "Weights/activations/KV dtype; auto picks the measured-fastest on this device.", ("auto", "float32", "bfloat16"), group="model")
    context_length: int | None = option(None, "Maximum context length (prompt + output); default: the model's (a sliding-window model's window).", group="model")
    attention_backend: str = option(
        "auto", "Attention implementation. torch_native: gather each request's KV from the pool, then SDPA. "
        "cpu_paged: decode rows by a C++ kernel that reads the KV in place, 1.4x faster decode steps at batch 64 "
        "(compiled by scripts/setup.sh, or on first use; needs g++ and ninja: if it cannot be built, choosing it "
        "fails at start with the reason); it also brings the fused C++ small ops (RMSNorm + residual, RoPE, "
        "SiLU x up; torch_native keeps the torch ones, the reference). auto: cpu_paged when its kernel builds "
        "here, else torch_native (and torch_native for layers with sliding windows or soft-capped scores: Gemma).",
        ("auto", "torch_native", "cpu_paged"), group="model")
    quantization: str = option(
        "auto", "Weight-only quantized copies of the linear weights, read by decode steps of at most "
        "--quantization-max-batch rows (larger steps keep the float weights). gguf: the GGUF file's own "
        "Q4_1 / Q8_0 blocks, bit for bit (needs AVX512-VNNI; about 2x faster at batch 1 than bfloat16). "
        "int4 (groups of 32 with a scale and a minimum, Q4_1's layout) and int8 (blocks of 32, Q8_0's; one "
        "scale per row where ATen's kernel runs): quantize any model. auto: gguf for a GGUF model in "
        "bfloat16 where the kernel runs, else none (float32 stays the exact reference). Tolerance and "
        "figures in docs/model.md.", ("auto", "none", "gguf", "int8", "int4"), group="model")
    quantization_max_batch: int | None = option(
        None, "Most rows (tokens) of a forward that uses the quantized weights; above it the float weights run "
        "(faster there). Default: 5 when the float weights are bfloat16, 8 when float32 (where each was "
        "measured to stop paying: docs/benchmarks.md).", group="model")
    random_seed: int = option(0, "Seed of the global sampler generator.", group="model")
    num_threads: int | None = option(None, "torch intra-op threads (default: torch's choice).", group="model")

    # --- memory ------------------------------------------------------------------------------
    max_total_tokens: int | None = option(
        None, "KV pool size in tokens. Default: sized from --mem-fraction-static of system memory.", group="memory"
    )
    mem_fraction_static: float = option(
        0.15, "Fraction of system memory given to the KV pool when --max-total-tokens is unset.", group="memory"
    )
    page_size: int = option(1, "Tokens per KV page; the radix cache matches whole pages only.", group="memory")
    disable_radix_cache: bool = option(False, "Use a ChunkCache that shares nothing instead of the RadixCache.", group="memory")
    radix_eviction_policy: str = option("lru", "Order in which unlocked radix leaves are evicted; queue-aware: leaves no waiting request "
        "is about to reuse first, then LRU.", RADIX_EVICTION_POLICIES, group="memory")

    # --- scheduling --------------------------------------------------------------------------
    schedule_policy: str = option(
        "fcfs", f"Order of the waiting queue: one of {', '.join(SCHEDULE_POLICIES)}, a policy registered by "
        "--policy-plugin, or module.path:ClassName (docs/qos.md).")
    max_running_requests: int | None = option(None, "Most requests in the running batch (default: from pool sizes).")
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
        "GPU server. Tensor parallelism and disaggregation always run the normal loop.", ("auto", "on", "off"))
    disable_overlap_schedule: bool = option(
        False, "SGLang's name for --overlap-schedule off (it wins over --overlap-schedule).")

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
    max_num_seqs: int = option(256, "--scheduler unified: most requests running at once.")
    long_prefill_token_threshold: int = option(
        0, "--scheduler unified: most prompt tokens of one request per step (0: no cap but the budget).")

    # --- server (HTTP process, TokenizerManager, scheduler/detokenizer processes) ----------------
    # Flag names follow SGLang's (--host, --port, --api-key, --enable-metrics, ...).
    host: str = option("127.0.0.1", "HTTP host to bind.", group="server")
    port: int = option(30000, "HTTP port to bind.", group="server")
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer <key>' on every endpoint but /health.", group="server"
    )
    admin_api_key: str | None = option(
        None, "Require this key (not --api-key) on the admin endpoints: /flush_cache, /abort_request, "
        "/set_schedule_policy (with radixserve launch, also the router's worker management). It opens every "
        "other endpoint too. Default: the admin endpoints take --api-key like the rest.", group="server")
    enable_metrics: bool = option(False, "Serve Prometheus metrics at /metrics.", group="server")
    max_request_body_bytes: int = option(
        16 * 1024 * 1024, "Largest HTTP request body accepted; a larger one is answered 413 (default 16 MiB).",
        group="server")
    decode_log_interval: int = option(40, "Log one line of batch statistics every N decode steps.", group="server")
    log_level: str = option("info", "Log level of every process.", ("debug", "info", "warning", "error"), group="server")
    stream_interval: int = option(1, "Send streamed output every N tokens (1: every token).", group="server")
    dp_size: int = option(
        1, "Data parallelism: N scheduler processes, each with its own model copy, KV pool and radix cache, "
        "behind a controller process that spreads requests over them (each rank gets its share of the CPU "
        "threads unless --num-threads is set).", group="server")
    load_balance_method: str = option(
        "round_robin", "--dp-size: how the controller picks a rank for a request that names none "
        "(data_parallel_rank pins one): in turn, the fewest requests, or the fewest tokens.",
        ("round_robin", "shortest_queue", "minimum_tokens"), group="server")
    cache_events_port: int | None = option(
        None, "Publish the radix cache's changes (prefixes stored, evicted, cleared) on a ZeroMQ PUB socket "
        "at tcp://<--host>:<port>, one batch per scheduler step, for a router's --enable-cache-events "
        "(SGLang's --kv-events-config). --dp-size N: rank r uses port + r. /get_server_info reports the "
        "endpoint. Default: off.", group="server")
    # NOTE: group "server", not a group of its own: the simulator builds its CLI from every group but
    # "model" and "server", and these mean nothing there.
    tp_size: int = option(
        1, "Tensor parallelism: shard every layer (attention heads, MLP, vocabulary) and the KV pool over N "
        "ranks, one process each, that run each step together over torch.distributed (gloo on CPU). The "
        "model's attention and KV head counts must be multiples of N (docs/scale-out.md).", group="server")
    nnodes: int = option(
        1, "--tp-size over several machines: the number of nodes; each runs --tp-size / --nnodes ranks.",
        group="server")
    node_rank: int = option(
        0, "This node's index in [0, --nnodes); node 0 runs the HTTP server and TP rank 0, the others only "
        "their TP ranks.", group="server")
    dist_init_addr: str | None = option(
        None, "host:port of torch.distributed's TCP store, served by TP rank 0 on node 0 (required with "
        "--nnodes > 1; default: a free local port).", group="server")

    # prefill/decode disaggregation (SGLang's flag names; radixserve/disagg, docs/scale-out.md)
    disaggregation_mode: str = option(
        "null", "Prefill/decode disaggregation: 'prefill' runs prompts and sends their KV to a decode worker, "
        "'decode' receives KV and decodes, 'null' does both (no disaggregation).", ("null", "prefill", "decode"),
        group="server")
    disaggregation_bootstrap_port: int = option(
        8998, "A prefill worker's bootstrap server port (data-parallel rank r: port + r), where decode workers "
        "register the rooms they wait for.", group="server")
    disaggregation_transfer_backend: str = option(
        "zmq", "How KV moves between workers: ZeroMQ over TCP, zero-copy frames.", ("zmq",), group="server")
    num_reserved_decode_tokens: int = option(
        512, "A decode worker refuses a request (429) unless its KV pool keeps this many tokens free for "
        "decoding after reserving the prompt.", group="server")
    disaggregation_timeout_secs: float = option(
        30.0, "Seconds a room may wait for its other half (KV on a decode worker; registration or "
        "acknowledgement on a prefill worker) before it is aborted and its KV freed.", group="server")

    def __post_init__(self) -> None:
        errors = (self._memory_errors() + self._disaggregation_errors() + self._server_errors()
                  + self._parallelism_errors() + self._scheduler_errors() + self._policy_errors())
        if errors:
            raise ValueError("invalid server arguments: " + "; ".join(errors))

    def _not_positive(self, name: str, allow_none: bool = True) -> list[str]:
        """The error of an option that must be a positive integer (or None, if allowed), if any."""
        v = getattr(self, name)
        if (v is None and allow_none) or (isinstance(v, int) and v > 0):
            return []
        return [f"{name} must be a positive integer, got {v!r}"]

    def _memory_errors(self) -> list[str]:
        """Sizes, memory, chunking and the chat template."""
        errors: list[str] = []
        t = self.chat_template
        if t is not None and not os.path.isfile(t) and "{{" not in t and "{%" not in t:
            errors.append(f"chat_template {t!r} is neither a file nor a Jinja template")
        for name in ("context_length", "max_total_tokens", "max_running_requests", "max_queued_requests",
                     "prefill_max_requests", "num_threads", "quantization_max_batch"):
            errors += self._not_positive(name)
        for name in ("page_size", "max_prefill_tokens", "new_token_ratio_decay_steps", "clip_max_new_tokens",
                     "max_request_body_bytes"):
            errors += self._not_positive(name, allow_none=False)
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size <= 0:
            errors.append("chunked_prefill_size must be positive or -1 (disabled)")
        if self.chunked_prefill_size > 0 and self.page_size > 0 and self.chunked_prefill_size % self.page_size:
            errors.append("chunked_prefill_size must be a multiple of page_size")
        if not 0.0 < self.mem_fraction_static < 1.0:
            errors.append("mem_fraction_static must be in (0, 1)")
        if not 0.0 <= self.init_new_token_ratio <= 1.0:
            errors.append("init_new_token_ratio must be in [0, 1]")
        if self.retract_decode_steps < 0:
            errors.append("retract_decode_steps must be >= 0")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):  # None: off
                errors.append(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        return errors

    def _disaggregation_errors(self) -> list[str]:
        """Prefill/decode disaggregation."""
        errors: list[str] = []
        if self.disaggregation_mode != "null":
            if not 1 <= self.disaggregation_bootstrap_port <= 65535:
                errors.append("disaggregation_bootstrap_port must be in [1, 65535]")
            if not self.disaggregation_timeout_secs > 0:
                errors.append("disaggregation_timeout_secs must be > 0")
            if self.num_reserved_decode_tokens < 0:
                errors.append("num_reserved_decode_tokens must be >= 0")
            if self.disable_radix_cache:
                errors.append("--disaggregation-mode hands KV over through the radix cache; it cannot be used "
                              "with --disable-radix-cache")
            if getattr(self, "tp_size", 1) != 1:
                errors.append("--disaggregation-mode does not support --tp-size > 1 yet")
        return errors

    def _server_errors(self) -> list[str]:
        """Ports, intervals, data parallelism and cache events."""
        errors: list[str] = []
        for name in ("decode_log_interval", "stream_interval", "dp_size"):  # server section
            errors += self._not_positive(name, allow_none=False)
        if not 0 <= self.port <= 65535:
            errors.append(f"port must be in [0, 65535], got {self.port}")
        if self.cache_events_port is not None:
            ranks = self.dp_size if isinstance(self.dp_size, int) and self.dp_size > 0 else 1
            last = self.cache_events_port + ranks - 1 if isinstance(self.cache_events_port, int) else 0
            if not isinstance(self.cache_events_port, int) or not 1 <= self.cache_events_port <= last <= 65535:
                errors.append(f"cache_events_port must be in [1, 65535] (with --dp-size N, port + N - 1 too), "
                              f"got {self.cache_events_port!r}")
            elif self.cache_events_port <= self.port <= last:
                errors.append(f"cache_events_port {self.cache_events_port} collides with the HTTP port {self.port}")
            if self.disable_radix_cache:
                errors.append("--cache-events-port reports the radix cache's changes; it cannot be used with "
                              "--disable-radix-cache")
        return errors

    def _scheduler_errors(self) -> list[str]:
        """Scheduling limits, priorities and the unified scheduler."""
        errors: list[str] = []
        for name in ("lpm_fallback_threshold", "in_batch_prefix_caching_check_threshold",
                     "in_batch_prefix_caching_deprioritize_threshold", "long_prefill_token_threshold"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                errors.append(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            errors += self._not_positive(name, allow_none=False)
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

    def _policy_errors(self) -> list[str]:
        """The schedule policy, dynamic chunking, and the quality-of-service options (qos_options.py)."""
        errors: list[str] = []
        if self.schedule_policy not in SCHEDULE_POLICIES and not self.policy_plugin and ":" not in self.schedule_policy:
            errors.append(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, a --policy-plugin "
                          f"policy or module.path:ClassName; got {self.schedule_policy!r}")
        if not self.dynamic_chunk_target_ms > 0:
            errors.append("dynamic_chunk_target_ms must be > 0")
        errors += self._qos_errors()
        return errors

    def _parallelism_errors(self) -> list[str]:
        errors = []
        for name in ("tp_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                errors.append(f"{name} must be a positive integer, got {v!r}")
        if errors:
            return errors
        if self.tp_size > 1 and self.dp_size > 1:
            errors.append("--tp-size and --dp-size > 1 together are not supported yet; use one or the other")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            errors.append(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.tp_size % self.nnodes:
            errors.append(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} "
                          "(each node runs tp_size / nnodes ranks)")
        if self.nnodes > 1 and self.dist_init_addr is None:
            errors.append("--nnodes > 1 needs --dist-init-addr host:port (reachable from every node)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                errors.append(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        return errors

    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def chunk_size(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    # --- CLI -----------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        add_dataclass_cli_args(cls, parser, skip)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return dataclass_from_cli_args(cls, ns)
