"""``Engine``: the whole serving stack in one process (model runner + scheduler + detokenizer).

    engine = Engine()                                  # the bundled SmolLM2, default options
    engine = Engine(model_path, dtype="float32", max_total_tokens=4096, schedule_policy="lpm")
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    out["text"], out["output_ids"], out["meta_info"]["cached_tokens"]

Every CLI option of ``ServerArgs`` is a keyword argument. The HTTP server runs the same pieces in
separate processes; this class is the offline API, the benchmark's engine and the test harness.

``Engine(tp_size=N)`` runs tensor-parallel rank 0 in this process and spawns ranks 1..N-1 as
processes of this machine; ``shutdown()`` (or leaving a ``with Engine(...)`` block) stops them.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.model.detokenize import IncrementalDetokenizer
from radixserve.model.model_runner import ModelRunner, runner_from_args
from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.io import InputLogprobsOut, OutRow, spec_meta
from radixserve.sched.req import Req
from radixserve.sched.request_checks import check_request, logprob_start
from radixserve.sched.sampling_params import InvalidRequest, SamplingParams
from radixserve.serving_build import build_scheduler

logger = logging.getLogger(__name__)



class RequestError(Exception):
    """A request the engine refused or aborted; ``status_code`` is the HTTP status to answer."""

    def __init__(self, reason: FINISH_ABORT) -> None:
        super().__init__(reason.message)
        self.reason = reason


@dataclass
class _Tracked:
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: InputLogprobsOut | None = None
    last: OutRow | None = None
    start: float = 0.0
    ttft: float | None = None
    spec: tuple[int, int] | None = None  # speculative decoding's counts, as last reported


class Engine:
    def __init__(self, model_path: str | None = None, *, runner: ModelRunner | None = None, **kwargs: Any) -> None:
        """``runner``: reuse an already loaded model (tests, benchmarks); its pools are rebuilt."""
        self.server_args = args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if args.dp_size != 1:
            raise ValueError("dp_size: data parallelism runs in the server (radixserve serve --dp-size N); "
                             "the in-process Engine has one scheduler")
        self._tp_procs: list[Any] = []
        self._stop_tp: Callable[[], None] = lambda: None
        if args.tp_size > 1:
            runner = self._start_tp(runner)
            args = self.server_args
        self.runner = runner or runner_from_args(args)
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.tokenizer.use_chat_template(args.chat_template)
        self.context_len = args.context_length or self.runner.max_context_len
        if self.context_len > self.runner.max_context_len:  # a runner built elsewhere, for a shorter context
            raise ValueError(f"context_length {self.context_len} is longer than the runner's "
                             f"{self.runner.max_context_len} (ModelRunner(context_length=...))")
        try:
            self.scheduler = build_scheduler(args, self.runner, self.context_len)
        except BaseException:
            self.shutdown()
            raise
        self._rid_counter = itertools.count()

    def _start_tp(self, runner: ModelRunner | None) -> ModelRunner:
        """Spawn ranks 1..N-1, join the group as rank 0 and load rank 0's shard."""
        from radixserve.model.loader import load_config
        from radixserve.model.parallel import check_tp_size
        from radixserve.model.tp_worker import load_tp_rank, spawn_tp_ranks, stop_tp_ranks, with_tp_defaults

        args = self.server_args
        if runner is not None:
            raise ValueError("tp_size > 1: the engine loads each rank's shard itself; pass no runner")
        if args.nnodes != 1:
            raise ValueError("the in-process Engine runs every tensor-parallel rank here: nnodes must be 1 "
                             "(radixserve serve --nnodes N runs across machines)")
        check_tp_size(load_config(args.model_path), args.tp_size)  # before anything is spawned
        self.server_args = args = with_tp_defaults(args)
        procs = self._tp_procs = spawn_tp_ranks(args, range(1, args.tp_size))
        holder: list[ModelRunner] = []
        # NOTE: a finalizer, not only shutdown(): it also runs at interpreter exit (before
        # multiprocessing kills its daemon children), so a script that never calls shutdown()
        # still stops the ranks with the stop message and leaves the group cleanly.
        self._stop_tp = weakref.finalize(self, stop_tp_ranks, holder, procs, torch.get_num_threads())
        try:
            runner = load_tp_rank(args, 0, alive=lambda: all(p.is_alive() for p in procs))
        except BaseException:
            self.shutdown()
            raise
        holder.append(runner)
        return runner

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (no-op without them) and let the KV tier finish its writes.
        The engine cannot run afterwards."""
        sched = getattr(self, "scheduler", None)
        if sched is not None:
            sched.kv.close()
        self._stop_tp()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        priority: int | list[int | None] | None = None,
        raise_on_error: bool = False,
        logprob_start_len: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list).

        A refused request comes back with ``meta_info.finish_reason.type == "abort"`` and the
        reason, like SGLang's, unless ``raise_on_error`` (then ``RequestError``). ``priority`` is one
        value for every prompt or a list with one per prompt. ``logprob_start_len``: the logprobs of
        the prompt tokens from this one on, in ``meta_info.input_token_logprobs`` (None for token 0;
        ``top_logprobs_num`` applies to them too); -1 or None: none."""
        single, reqs = self._make_reqs(prompt, sampling_params, input_ids, priority, logprob_start_len)
        results: dict[str, dict[str, Any]] = {}
        for rid, _tracked, _delta, done in self._run(reqs):
            if done is not None:
                results[rid] = done
        out = [results[r.rid] for r in reqs]
        if raise_on_error:
            for o in out:
                fr = o["meta_info"]["finish_reason"]
                if fr and fr["type"] == "abort":
                    raise RequestError(FINISH_ABORT(fr["message"], status_code=fr["status_code"], code=fr["code"]))
        return out[0] if single else out

    def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        priority: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yield ``{"text": delta, "output_ids": new ids, "finished": bool, "meta_info": ...}``."""
        _, reqs = self._make_reqs(prompt, sampling_params, input_ids, priority)
        for _rid, tracked, delta, done in self._run(reqs, stream=True):
            assert tracked.last is not None
            yield {
                "text": delta,
                "output_ids": tracked.last.new_token_ids,
                "finished": done is not None,
                "meta_info": self._meta(tracked),
            }

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def check_memory_invariant(self) -> None:
        self.scheduler.kv.check_invariant()

    # --- internals -----------------------------------------------------------------------------
    def _make_reqs(
        self,
        prompt: str | list[str] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        input_ids: list[int] | list[list[int]] | None,
        priority: int | list[int | None] | None,
        logprob_start_len: int | None = None,
    ) -> tuple[bool, list[Req]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        ids_list: list[list[int]]
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self.tokenizer.encode(t) for t in texts]
        else:
            assert input_ids is not None
            single = not input_ids or not isinstance(input_ids[0], list)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[arg-type]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError("one sampling_params per prompt, or a single dict for all")
            sps = sampling_params
        else:
            sps = [sampling_params or {}] * len(ids_list)
        if isinstance(priority, list):
            if len(priority) != len(ids_list):
                raise ValueError("one priority per prompt, or a single value for all")
            prios = list(priority)
        else:
            prios = [priority] * len(ids_list)
        now = self.scheduler.clock()
        limits = self.scheduler.limits()
        reqs = []
        for ids, sp, prio in zip(ids_list, sps, prios, strict=True):
            try:
                params = SamplingParams.from_dict(sp, self.model_config.vocab_size)
            except (InvalidRequest, TypeError) as e:
                params = None
                err = FINISH_ABORT(str(e), param=getattr(e, "param", None))
            req = Req(f"eng-{next(self._rid_counter)}-{uuid.uuid4().hex[:8]}", ids, params or SamplingParams(),
                      arrival_time=now, priority=prio, eos_token_ids=tuple(self.tokenizer.stop_token_ids))
            if params is None:
                req.to_abort = err
            else:
                req.to_abort = check_request(req, limits)  # what the scheduler trusts (request_checks.py)
            start = logprob_start(logprob_start_len, len(ids))
            if isinstance(start, FINISH_ABORT):
                req.to_abort = req.to_abort or start
            elif start is not None:
                req.want_input_logprobs(start)
            reqs.append(req)
        return single, reqs

    def _run(
        self, reqs: Sequence[Req], stream: bool = False
    ) -> Iterator[tuple[str, _Tracked, str, dict[str, Any] | None]]:
        sched = self.scheduler
        tracked: dict[str, _Tracked] = {}
        pending = set()
        for req in reqs:
            req.stream = stream  # without it, decode steps send nothing until the request finishes
            sp = req.sampling_params
            tracked[req.rid] = _Tracked(
                IncrementalDetokenizer(self._decoder(sp.skip_special_tokens), sp.stop), start=time.perf_counter()
            )
            pending.add(req.rid)
            if req.to_abort is not None:  # refused where it entered: finish through the normal path
                sched.finish(req, req.to_abort)
            else:
                sched.add_request(req)
        outs = sched.take_outputs()
        overlap = sched.overlap_enabled()
        step = sched.step_overlapped if overlap else sched.step
        while True:
            for e in outs.input_logprobs:
                if e.rid in tracked:
                    tracked[e.rid].input_logprobs = e
            for o in outs:
                t = tracked.get(o.rid)
                if t is None:
                    continue
                t.last = o
                t.spec = o.spec or t.spec
                if t.ttft is None and o.new_token_ids:
                    t.ttft = time.perf_counter() - t.start
                t.output_ids.extend(o.new_token_ids)
                t.logprobs.extend(o.new_logprobs)
                t.top_logprobs.extend(o.new_top_logprobs)
                finished = o.finished_reason is not None
                delta = t.detok.feed(o.new_token_ids, finished=finished)
                if finished:
                    pending.discard(o.rid)
                    yield o.rid, t, delta, self._result(t)
                elif stream:
                    yield o.rid, t, delta, None
            if not pending:
                break
            outs = step()
        if overlap:
            sched.drain_in_flight()  # a step scheduled ahead holds only requests that ended
        if not sched.has_work():
            sched.step()  # the idle step runs the memory self-check

    def _decoder(self, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
        tok = self.tokenizer
        return lambda ids: tok.decode(list(ids), skip_special_tokens)

    def _meta(self, t: _Tracked) -> dict[str, Any]:
        o = t.last
        assert o is not None
        return {
            "id": o.rid,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens,
            "finish_reason": o.finished_reason.to_json() if o.finished_reason else None,
            "e2e_latency": time.perf_counter() - t.start,
            "ttft": t.ttft,
            "num_retractions": o.num_retractions,
            **spec_meta(t.spec),
        }

    def _result(self, t: _Tracked) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text": t.detok.output_text,
            "output_ids": t.output_ids,
            "meta_info": self._meta(t),
        }
        if t.logprobs:
            out["meta_info"]["output_token_logprobs"] = t.logprobs
        if t.top_logprobs:
            out["meta_info"]["output_top_logprobs"] = t.top_logprobs
        if t.input_logprobs is not None:
            out["meta_info"]["input_token_logprobs"] = t.input_logprobs.logprobs
            out["meta_info"]["input_top_logprobs"] = t.input_logprobs.top_logprobs
        return out
