"""``GrammarQueue``: requests with a grammar wait here until it is compiled, off the scheduler loop.

A request whose grammar was compiled before gets a copy of it at once and goes straight to the
waiting queue. Any other waits here while the compile thread builds it (``GrammarCompiler``); the
loop collects what is ready at the start of each step (``poll``) and, with nothing else to do,
waits a little on the compile instead of spinning (``wait``). A grammar that does not compile ends
its request with a 400 naming the field; an abort takes a request out of here like out of the
waiting queue.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

from radixserve.sched.finish import FINISH_ABORT
from radixserve.sched.req import Req


class Compiler(Protocol):
    """What the queue needs of ``radixserve.grammar.GrammarCompiler``."""

    def cached(self, kind: str, text: str) -> Any | None: ...

    def submit(self, kind: str, text: str) -> Future: ...


class GrammarQueue:
    def __init__(self, compiler: Compiler | None, end: Callable[[Req, FINISH_ABORT], None]) -> None:
        self.compiler = compiler
        self.end = end  # finishes a request that holds no KV (Outputs.end)
        self.pending: dict[Req, Future] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def park(self, req: Req) -> bool:
        """Whether ``req`` must wait here (its grammar is being compiled). False: it has no grammar,
        or its matcher is ready (``req.grammar``), or it has been ended (no compiler here)."""
        spec = req.sampling_params.grammar
        if spec is None:
            return False
        if self.compiler is None:
            self.end(req, FINISH_ABORT(f"{spec[0]}: structured output needs the model's tokenizer, which this "
                                       "engine does not have", code="unsupported", param=spec[0]))
            return True
        matcher = self.compiler.cached(*spec)
        if matcher is not None:
            req.grammar = matcher
            return False
        self.pending[req] = self.compiler.submit(*spec)
        return True

    def poll(self) -> list[Req]:
        """The requests whose grammar is ready now, in arrival order (the failed ones are ended)."""
        if not self.pending:
            return []
        ready: list[Req] = []
        for req, fut in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[req]
            err = fut.exception()
            if err is None:
                req.grammar = fut.result()
                ready.append(req)
            else:
                kind = req.sampling_params.grammar[0]  # type: ignore[index]
                self.end(req, FINISH_ABORT(f"invalid {kind}: {err}", code="invalid_value", param=kind))
        return ready

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or ``timeout`` seconds pass (the loop has nothing else to do)."""
        if self.pending:
            wait_futures(list(self.pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, req: Req) -> bool:
        """Take ``req`` out (an abort); its compile finishes and is cached, unused."""
        return self.pending.pop(req, None) is not None
