"""Benchmark workloads as token ids, shared by the offline and the serving benchmarks so their
numbers compare. Prompts are drawn from ordinary (non-special) token ids with a fixed seed.

- ``random``: independent prompts of ``input_len`` tokens.
- ``shared-prefix``: ``num_groups`` groups; each group's prompts share a ``system_len``-token system
  prompt and differ in a ``question_len``-token question.
- ``multi-turn``: conversations whose every turn extends the previous turn's prompt. Offline, a turn's
  prompt holds a random stand-in for the previous answer; ``bench serve`` sends, as a chat does, the
  previous turn's prompt + the answer the server really generated + the turn's new user tokens
  (``BenchRequest.user_ids``), so the server's prefix cache sees the whole history again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    input_ids: list[int]
    max_new_tokens: int
    group: int = 0
    turn: int = 0
    # multi-turn, turn > 0: input_ids == previous turn's input_ids + stand_in_reply + user_ids
    user_ids: list[int] = field(default_factory=list)
    stand_in_reply: list[int] = field(default_factory=list)


def _tokens(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def random_workload(
    num_prompts: int = 128, input_len: int = 256, output_len: int = 128, vocab: int = 49152, seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, input_len, 200, vocab - 200), output_len) for _ in range(num_prompts)]


def shared_prefix_workload(
    num_groups: int = 8,
    prompts_per_group: int = 16,
    system_len: int = 512,
    question_len: int = 64,
    output_len: int = 128,
    vocab: int = 49152,
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    systems = [_tokens(rng, system_len, 200, vocab - 200) for _ in range(num_groups)]
    for g in range(num_groups):
        for _ in range(prompts_per_group):
            out.append(BenchRequest(systems[g] + _tokens(rng, question_len, 200, vocab - 200), output_len, group=g))
    rng.shuffle(out)  # arrivals interleave the groups
    return out


def multi_turn_workload(
    num_conversations: int = 16,
    num_turns: int = 4,
    first_len: int = 256,
    turn_len: int = 64,
    output_len: int = 64,
    vocab: int = 49152,
    seed: int = 0,
) -> list[BenchRequest]:
    """Turn t of a conversation = turn t-1's prompt + a stand-in for its answer + a new message
    (``bench serve`` replaces the stand-in by the real answer)."""
    rng = random.Random(seed)
    out = []
    for c in range(num_conversations):
        prompt = _tokens(rng, first_len, 200, vocab - 200)
        reply: list[int] = []
        user: list[int] = []
        for t in range(num_turns):
            out.append(BenchRequest(list(prompt), output_len, group=c, turn=t, user_ids=user, stand_in_reply=reply))
            # NOTE: one draw for answer + message, so the offline workload stays what it always was
            new = _tokens(rng, output_len + turn_len, 200, vocab - 200)
            reply, user = new[:output_len], new[output_len:]
            prompt = prompt + new
    return out


WORKLOADS = ("random", "shared-prefix", "multi-turn")


def make_workload(name: str, **kw: int) -> list[BenchRequest]:
    if name == "random":
        return random_workload(**kw)
    if name == "shared-prefix":
        return shared_prefix_workload(**kw)
    if name == "multi-turn":
        return multi_turn_workload(**kw)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
