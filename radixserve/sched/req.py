"""``Req``: one request as the scheduler sees it: a few integer counters, the rest derived.

    fill_ids = origin_input_ids + output_ids          (num_tokens of them)
    kv_indices[i] = KV slot of token i                 (num_computed_tokens of them)

Prefill, chunked prefill, decode, a prefix-cache hit and recompute after retraction are all the
same thing: a gap between ``num_computed_tokens`` and ``num_tokens`` that the next extend closes
(all of it, or a chunk of it).

    [0 .. cache_protected_len)      KV owned by the radix cache, pinned through last_node
    [cache_protected_len .. num_computed_tokens)   KV this request owns
    [num_computed_tokens .. num_tokens)            still to compute (the last sampled token's KV
                                                   is written by the next decode step)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from radixserve.mem.base_cache import MatchResult, RadixKey
from radixserve.mem.tree_node import TreeNode
from radixserve.sched.finish import FINISH_ABORT, FinishReason
from radixserve.sched.sampling_params import SamplingParams


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float = 0.0,
        priority: int | None = None,
        extra_key: str | None = None,
        eos_token_ids: tuple[int, ...] | frozenset[int] = (),
        stream: bool = True,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = arrival_time
        self.priority = priority
        self.requested_priority = priority  # as sent; ``priority`` may get the default (metrics labels)
        self.extra_key = extra_key
        self.eos_token_ids = frozenset(eos_token_ids)
        # False (a non-streaming API call): decode steps send nothing for this request; its tokens
        # go out with the step that produced its first one and with its finish, as SGLang does
        self.stream = stream

        # memory
        self.req_pool_idx: int | None = None
        self.kv_indices: list[int] = []
        self.cache_protected_len = 0
        # a whole-model sliding window (KVManager): its own slots [cache_protected_len, kv_freed_to)
        # were freed, no later token reading them; their kv_indices entries are stale until it ends
        self.kv_freed_to = 0
        # sliding-window layers among global ones (KVManager): the window pages of its own slots
        # [cache_protected_len, window_dropped_to) were given back, the main slots kept
        self.window_dropped_to = 0
        self.last_node: TreeNode | None = None  # where its cached prefix ends in the radix tree
        # the prefix the KV tier loaded for it, locked until it is admitted (KVManager.admit) or leaves
        self.tier_hold: TreeNode | None = None

        # this round's plan (set by KVManager.match / the adder)
        self.prefix_indices: Sequence[int] = ()  # the matched prefix's slots (an int64 array once matched)
        self.extend_input_len = 0
        self.is_chunked = False

        # outcome & stats
        self.finished_reason: FinishReason | None = None
        self.to_abort: FINISH_ABORT | None = None
        self.cached_tokens = 0
        self.num_retractions = 0
        self.num_preemptions = 0
        # scheduling policies
        self.queue_entry_time: float | None = None  # when queued (scheduler clock); --queue-timeout
        # what the schedule policy keeps per request (lpm: ``policies.prefix_match.LPMState``); its
        # ``reset()`` is called when the request's key grows (retraction)
        self.policy_state: Any = None
        self.admitted_before = False
        self.first_scheduled_time: float | None = None
        self.queue_time = 0.0  # arrival -> first scheduled (set with first_scheduled_time)
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.output_logprobs: list[float] = []
        # prompt logprobs (``echo`` with ``logprobs``, ``logprob_start_len``): wanted for the prompt
        # tokens from ``input_logprob_start`` on (None: not wanted); entry ``j - start`` is token
        # ``j``'s, None for token 0 (nothing precedes it). Complete once the first output token is.
        self.input_logprob_start: int | None = None
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.sent_len = 0  # output tokens already streamed out
        # scheduling extensions (docs/qos.md); plain attributes the server and the simulator set
        self.tenant: str | None = None  # vtc fairness: the OpenAI `user` field or an x-tenant header
        self.deadline: float | None = None  # TTFT deadline, absolute, on the scheduler clock (edf)
        self.tpot_slo: float | None = None  # TPOT deadline, seconds per output token after the first
        self.penalized = self.sampling_params.has_penalties  # ScheduleBatch hands the sampler its history
        # the matcher of its grammar once compiled (radixserve.grammar; the sampler advances it on the
        # thread that runs the forward), None without one
        self.grammar: Any = None
        # speculative decoding (sched/spec.py): the request's n-gram drafter, verify steps that
        # carried its drafts, and the drafts the target accepted
        self.spec: Any = None
        self.spec_verify_ct = 0
        self.spec_accepted_tokens = 0

    # --- derived counters --------------------------------------------------------------------
    @cached_property
    def finish_token_ids(self) -> frozenset[int]:
        """Token ids that end this request: its EOS ids (unless ``ignore_eos``) and its
        ``stop_token_ids``; read from the first decode step on, after ``add_request`` set them."""
        sp = self.sampling_params
        eos = frozenset() if sp.ignore_eos else self.eos_token_ids
        return eos | frozenset(sp.stop_token_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def num_computed_tokens(self) -> int:
        return len(self.kv_indices)

    @property
    def own_kv_tokens(self) -> int:
        """KV slots this request holds itself (not the cache's, not freed behind a window)."""
        return len(self.kv_indices) - max(self.cache_protected_len, self.kv_freed_to)

    @property
    def kv_token_ids(self) -> list[int]:
        n = len(self.kv_indices)
        k = len(self.origin_input_ids)
        return self.origin_input_ids[:n] if n <= k else self.origin_input_ids + self.output_ids[: n - k]

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def finished(self) -> bool:
        return self.finished_reason is not None

    # --- scheduling --------------------------------------------------------------------------
    def want_input_logprobs(self, start: int) -> None:
        """Ask for the logprobs of the prompt tokens from ``start`` on (``0 <= start < prompt_len``)."""
        self.input_logprob_start = start
        self.input_logprobs = [None] * (self.prompt_len - start)
        self.input_top_logprobs = [None] * (self.prompt_len - start)

    def match_key(self) -> RadixKey:
        """What to look up in the prefix cache: every token but the last, whose logits give the next
        token (so at least one token is always computed). While prompt logprobs are pending, only the
        tokens before the first position whose logits they need: those must be computed."""
        fill = self.fill_ids
        n = len(fill) - 1
        if self.input_logprob_start is not None and not self.output_ids:
            n = min(n, max(self.input_logprob_start - 1, 0))
        return RadixKey(fill[:n], self.extra_key)

    def set_match(self, match: MatchResult) -> None:
        """Take a prefix-cache match of ``match_key()`` as this round's plan: the cached prefix, the
        node that ends it, and the extend left to compute."""
        self.prefix_indices = match.device_indices
        self.last_node = match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        """Back to a waiting request; its outputs so far stay and are recomputed as prompt."""
        self.prefix_indices = ()
        self.extend_input_len = 0
        self.is_chunked = False
        if self.policy_state is not None:  # its key grew: what the policy knew of it is stale
            self.policy_state.reset()

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"computed={self.num_computed_tokens})")
