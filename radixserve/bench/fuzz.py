"""``radixserve bench fuzz``: schemathesis over ``/openapi.json`` and a mutation fuzzer of valid
bodies against a real server; the verdict is zero 5xx and a healthy server after.

- schemathesis: every operation the server documents (the OpenAI routes included), in both
  generation modes: *positive* cases fit the schema (they reach the engine when the server's own
  checks agree), *negative* ones break it somewhere (each must be a 4xx). Param-less routes yield
  one case per mode at most; the body routes get the rest of ``--cases``, in rounds with a new seed
  until the count is reached. Cases run one after another, seeded, with Hypothesis's example
  database off (nothing is written to disk).
- the mutation fuzzer: the valid bodies of ``VALID`` with one to three fields replaced by values
  of the wrong type, huge numbers, deep nesting, odd Unicode, or unknown names (``mutate``); the
  same code runs in ``tests/server/test_api_edge.py`` at a small count.

Generated bodies may ask for many tokens (``n`` up to 64, no ``max_tokens``: as many as fit); a
started server gets a small context (``DEFAULT_SERVER_ARGS``: 64 tokens, of which the bundled chat
template takes about 30) so that no case takes long, rather than capping the bodies.
``clamp_lengths`` caps them instead, for a short run against a server with a long context (tests).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from radixserve.bench.subprocs import BenchError
from radixserve.bench.target import Target, add_target_args
from radixserve.results import write_result

DEFAULT_SERVER_ARGS = ("--context-length 64 --max-total-tokens 4096 --max-running-requests 32 "
                       "--enable-metrics --decode-log-interval 200 --log-level warning")
BODY_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses")
MESSAGES = [{"role": "user", "content": "Say hello."}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/responses": {"input": "Say hello.", "max_output_tokens": 2, "temperature": 0},
}
# every field name of the four bodies (and their extension fields), so a mutation can hit any
FIELDS = sorted({
    "model", "n", "stream", "stream_options", "stop", "temperature", "top_p", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "min_tokens", "repetition_penalty",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "priority", "prompt", "max_tokens", "logprobs", "echo",
    "suffix", "best_of", "return_token_ids", "messages", "max_completion_tokens", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "modalities", "metadata", "store",
    "service_tier", "prediction", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "text",
    "input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num", "logprob_start_len",
    "return_text_in_logprobs", "ttft_slo_ms", "tpot_slo_ms", "data_parallel_rank", "data_parallel_rank_decode",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "tenant",
    "deadline_ms", "regex", "ebnf", "reasoning_effort", "chat_template_kwargs", "separate_reasoning",
    "input", "instructions", "previous_response_id", "max_output_tokens", "include", "reasoning", "truncation",
    "background", "max_tool_calls"})
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens",
                 "max_output_tokens"}
INT64_MAX = (1 << 63) - 1


def _odd_values(rng: random.Random) -> list[Any]:
    deep: Any = 1
    for _ in range(rng.randint(1, 300)):
        deep = [deep] if rng.random() < 0.5 else {"k": deep}
    return [None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**30, 0.5, -0.0, 1e300, "", "x" * 1000,
            "\u0000\ud7ff\ue000\U0010ffff", [], {}, [1, "a", None], {"5": "x"}, {"": []}, deep, [deep]]


def mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with one to three fields (top level or in ``sampling_params``) dropped or replaced
    by an odd value. A length field never gets a positive count under a million (no long
    generation), nor is it removed to mean "as many as fit"."""
    body = dict(body)
    if isinstance(body.get("sampling_params"), dict):
        body["sampling_params"] = dict(body["sampling_params"])
    for _ in range(rng.randint(1, 3)):
        target = body
        if isinstance(body.get("sampling_params"), dict) and rng.random() < 0.4:
            target = body["sampling_params"]
            key = rng.choice([*target, "top_k", "min_p", "logit_bias", "stop", "seed", "repetition_penalty",
                              "json_schema", "regex", "ebnf"])
        else:
            key = rng.choice([*body, *FIELDS]) if rng.random() < 0.8 else "".join(rng.choices("abcxyz_", k=5))
        if rng.random() < 0.15 and key not in LENGTH_FIELDS:
            target.pop(key, None)
            continue
        value = rng.choice(_odd_values(rng))
        if key in LENGTH_FIELDS and (value is None or isinstance(value, int) and 0 < value < 10**6):
            value = -1
        target[key] = value
    return body


def clamp_lengths(body: Any, cap: int) -> Any:
    """``body`` with every in-range length field above ``cap`` set to ``cap`` (and ``n`` to at most 4):
    for a short fuzz against a long-context server. Out-of-range values (negative, past 64 bits)
    and wrong types are left for the server to refuse."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for k, v in out.items():
        if isinstance(v, bool):
            continue
        if k in LENGTH_FIELDS and isinstance(v, int) and cap < v <= INT64_MAX:
            out[k] = cap
        elif k == "n" and isinstance(v, int) and 4 < v <= 64:
            out[k] = 4
        elif k == "sampling_params":
            out[k] = [_clamp_sampling(x, cap) for x in v] if isinstance(v, list) else _clamp_sampling(v, cap)
    if out.get("max_tokens", 0) is None or ("messages" in out and "max_tokens" not in out
                                            and "max_completion_tokens" not in out):
        out["max_tokens"] = cap  # none means "as many as fit in the context"
    if "input" in out and out.get("max_output_tokens") is None:  # a Responses body: the same
        out["max_output_tokens"] = cap
    return out


def _clamp_sampling(sp: Any, cap: int) -> Any:
    if isinstance(sp, dict):
        sp = clamp_lengths(sp, cap)
        sp.setdefault("max_new_tokens", cap)
    return sp


class Tally:
    """Status codes per source, the 5xx and transport failures with a way to reproduce each."""

    def __init__(self) -> None:
        self.statuses: dict[str, Counter[int]] = {}
        self.failures: list[str] = []

    def add(self, source: str, status: int | None, what: str, reply: str = "") -> None:
        self.statuses.setdefault(source, Counter())[status or 0] += 1
        if status is None or status >= 500:
            self.failures.append(f"[{source}] {status or 'no answer'}: {what}\n    -> {reply[:300]}")

    def cases(self, source: str | None = None) -> int:
        return sum(sum(c.values()) for s, c in self.statuses.items() if source in (None, s))

    def histogram(self) -> Counter[int]:
        total: Counter[int] = Counter()
        for c in self.statuses.values():
            total.update(c)
        return total


def _without_noop_fields(schema: Any) -> Any:
    """``schema`` without the properties marked ``x-noop`` (fields other servers define, accepted
    here only at their no-op values; their unit tests cover them): dozens of optional properties
    would multiply what hypothesis draws per case, the fuzz's time, and find nothing new."""
    if isinstance(schema, list):
        return [_without_noop_fields(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _without_noop_fields(v) for k, v in schema.items()}
    props = out.get("properties")
    if isinstance(props, dict):
        out["properties"] = {k: v for k, v in props.items() if not (isinstance(v, dict) and v.get("x-noop"))}
    return out


def run_schemathesis(target: Target, cases: int, seed: int, tally: Tally, timeout: float,
                     cap: int | None = None, skip: tuple[str, ...] = (),
                     progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """At least ``cases`` schemathesis cases over every operation of ``/openapi.json`` but the paths
    in ``skip``; returns the cases per operation."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.result import Ok

    raw = _without_noop_fields(target.client.get("/openapi.json").json())
    schema = schemathesis.openapi.from_dict(raw)
    ops = []
    for r in schema.get_all_operations():
        if not isinstance(r, Ok):
            raise BenchError(f"/openapi.json has an operation schemathesis cannot read: {r.err()}")
        if r.ok().path not in skip:
            ops.append(r.ok())
    per_op: Counter[str] = Counter()
    session = requests.Session()
    session.headers.update(target.headers)

    def run_op(op: Any, mode: GenerationMode, n: int, round_seed: int) -> None:
        @hypothesis_seed(round_seed)
        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def one(case: Any) -> None:
            if cap is not None:
                case.body = clamp_lengths(case.body, cap)
            label = f"{op.method.upper()} {op.path}"
            try:
                r = case.call(base_url=target.url, session=session, timeout=timeout)
                tally.add("schemathesis", r.status_code, case.as_curl_command(), r.text)
            except requests.RequestException as e:
                tally.add("schemathesis", None, case.as_curl_command(), repr(e))
            per_op[f"{label} ({mode.value})"] += 1
            if progress is not None:
                progress(1)

        try:
            one()
        except Unsatisfiable:  # no parameters to break (negative) or nothing more to generate
            pass

    body_ops = [op for op in ops if op.body]
    other = [op for op in ops if not op.body]
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    for op in other:
        for mode in modes:
            run_op(op, mode, 10, seed)
    round_no = 0
    while tally.cases("schemathesis") < cases and round_no < 20:
        left = cases - tally.cases("schemathesis")
        each = max(5, -(-left // (len(body_ops) * len(modes))))
        for op in body_ops:
            for mode in modes:
                run_op(op, mode, each, seed + 1 + round_no)
        round_no += 1
    return dict(per_op)


def run_mutations(target: Target, count: int, seed: int, tally: Tally, timeout: float,
                  progress: Callable[[int], None] | None = None) -> None:
    import httpx

    rng = random.Random(seed)
    for i in range(count):
        route = BODY_ROUTES[i % len(BODY_ROUTES)]
        body = mutate(rng, VALID[route])
        try:
            r = target.client.post(route, json=body, timeout=timeout)
            tally.add("mutation", r.status_code, f"POST {route} {str(body)[:500]}", r.text)
        except httpx.HTTPError as e:
            tally.add("mutation", None, f"POST {route} {str(body)[:500]}", repr(e))
        if progress is not None:
            progress(1)


def add_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--cases", type=int, default=1000,
                   help="Schemathesis cases, at least (every route, positive and negative).")
    p.add_argument("--mutations", type=int, default=3000, help="Mutation-fuzzer requests (valid bodies mutated).")
    p.add_argument("--seed", type=int, default=0, help="Seed of both fuzzers.")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="Per-request timeout (s); a request without an answer counts as a failure.")
    p.add_argument("--clamp-tokens", type=int, default=None,
                   help="Cap the length fields of generated bodies at this (for a server with a long context); "
                        "the default, no cap, relies on the started server's small --context-length.")
    p.add_argument("--skip-routes", default="",
                   help="Comma-separated paths schemathesis leaves out (e.g. /set_schedule_policy against a server "
                        "whose policy must not change).")
    p.add_argument("--output", default=None, help="Write the results as JSON here.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def main(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        import schemathesis  # noqa: F401
    except ImportError:
        print("error: bench fuzz needs schemathesis (pip install 'radixserve[dev]')", file=sys.stderr)
        return 2
    target = Target(ns)
    tally = Tally()
    try:
        target.wait_ready()
        t0 = time.perf_counter()
        with tqdm(total=ns.cases + ns.mutations, desc="fuzz", unit="case", disable=ns.disable_tqdm) as bar:
            skip = tuple(r.strip() for r in ns.skip_routes.split(",") if r.strip())
            per_op = run_schemathesis(target, ns.cases, ns.seed, tally, ns.timeout, ns.clamp_tokens, skip,
                                      bar.update)
            run_mutations(target, ns.mutations, ns.seed, tally, ns.timeout, bar.update)
        elapsed = time.perf_counter() - t0
        health = target.healthy_after()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        target.stop()
    print(f"\nschemathesis: {tally.cases('schemathesis')} cases over {len(per_op)} operation x mode pairs")
    for name, n in sorted(per_op.items()):
        print(f"  {n:6d}  {name}")
    print(f"mutation fuzzer: {tally.cases('mutation')} requests")
    for source, counts in sorted(tally.statuses.items()):
        print(f"status codes ({source}): " + ", ".join(f"{s or 'none'}: {n}" for s, n in sorted(counts.items())))
    fives = sum(n for s, n in tally.histogram().items() if not s or s >= 500)
    print(f"cases run: {tally.cases()} in {elapsed:.0f} s; 5xx or no answer: {fives}")
    for line in tally.failures[:20]:
        print(line)
    print(f"server healthy after: {health['ok']} (/health {health.get('health')}, generation "
          f"{(health.get('generation') or {}).get('status')}, memory {health.get('memory')})")
    for p in health["problems"]:
        print(f"  problem: {p}")
    if ns.output:
        write_result(ns.output, {"cases": tally.cases(), "schemathesis_cases": tally.cases("schemathesis"),
                                 "mutation_cases": tally.cases("mutation"), "per_operation": per_op,
                                 "statuses": {s: dict(c) for s, c in tally.statuses.items()}, "5xx": fives,
                                 "failures": tally.failures, "elapsed_s": round(elapsed, 1), "health": health})
    return 0 if fives == 0 and health["ok"] else 1
