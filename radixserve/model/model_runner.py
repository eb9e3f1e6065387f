"""``ModelRunner``: the real model behind the scheduler's ``Runner`` protocol.

Loads config + weights + tokenizer, builds the model in the chosen dtype, owns the sampler and, once
the engine has sized them, the KV pools::

    runner = ModelRunner(None)                      # bundled SmolLM2, dtype "auto"
    kv = runner.make_kv_pool(size=32768, page_size=16)
    r2t = runner.make_req_to_token_pool(size=256)
    runner.attach_pools(kv, r2t)
    out = runner.forward(batch)                     # ForwardOutput, one token per request

Under tensor parallelism (``tp_group``) every rank has a ``ModelRunner`` over its shard. Rank 0's is
the one the scheduler drives: ``attach_pools`` sends the pool sizes to the other ranks and each
``forward`` first broadcasts the batch to them (parallel.py); the other ranks run ``tp_worker``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from radixserve.config.speculative import DRAFT_MODEL_ALGORITHMS
from radixserve.mem.forward_batch import ForwardBatch, ForwardOutput, PromptLogprobs
from radixserve.mem.kv_format import kv_format
from radixserve.mem.kv_pool import JournaledReqToTokenPool, KVPool, ReqToTokenPool
from radixserve.model.config import ModelConfig
from radixserve.model.draft import DraftModel
from radixserve.model.gguf_blocks import GGUFWeight
from radixserve.model.host import configure_threads, tune_malloc
from radixserve.model.linear import Linear
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import load_model, model_identity, resolve_model_path
from radixserve.model.parallel import TPGroup, check_tp_size, send_step, send_stop
from radixserve.model.quant import check_quantization, default_max_rows
from radixserve.model.run_options import resolve_dtype, resolve_quantization, windowed
from radixserve.model.sampler import Sampler, prompt_logprobs
from radixserve.model.spec_verify import verified_logprobs, verify_drafts
from radixserve.model.tokenizer import Tokenizer, gguf_stop_token_ids

if TYPE_CHECKING:
    from radixserve.config.model import ModelOptions

logger = logging.getLogger(__name__)


def runner_from_args(args: ModelOptions, progress: bool = True, tp_group: TPGroup | None = None) -> ModelRunner:
    """The ``ModelRunner`` a server's options describe (every place that builds one from them)."""
    return ModelRunner(
        args.model_path, dtype=args.dtype, attention_backend=args.attention_backend, seed=args.random_seed,
        num_threads=args.num_threads, quantization=args.quantization, quant_max_rows=args.quantization_max_batch,
        progress=progress, tp_group=tp_group, context_length=args.context_length,
        kv_cache_dtype=args.kv_cache_dtype,
    )


class ModelRunner:
    def __init__(
        self,
        model_path: str | None = None,
        dtype: str | torch.dtype = "auto",
        attention_backend: str = "auto",
        *,
        num_threads: int | None = None,
        seed: int | None = None,
        quantization: str = "auto",
        quant_max_rows: int | None = None,
        quant_kernel: str = "auto",
        pack_weights: bool = True,
        tune_malloc_arena: bool = True,
        progress: bool = True,
        tp_group: TPGroup | None = None,
        context_length: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """Load the model at ``model_path`` (None: bundled SmolLM2-135M-Instruct GGUF).

        ``pack_weights``: pre-pack linear weights for oneDNN (float32, and bfloat16 where the CPU has
        native bf16: faster on CPU; the plain copies are then freed). ``quantization``: ``gguf``
        (a GGUF file's quantized matrices kept in their blocks, no float copy), ``none`` (float
        weights), ``int8`` or ``int4`` weight-only copies of every float linear, or ``auto``
        (``resolve_quantization``). ``quant_max_rows``: the inputs up to which the int8/int4
        copies serve, and the block kernel multiplies row by row instead of by tiles (None:
        ``default_max_rows`` of the dtype; quant.py; ``quant_kernel``: ``auto``, ``block`` or
        ``aten``, see ``quantize_weight``). int8/int4 copies are made from float32 weights, so a
        bfloat16 model's copies hold the file's values, not their bfloat16 rounding. ``seed``
        seeds the sampler's generator for unseeded requests.
        ``tune_malloc_arena``: see ``tune_malloc`` (process-wide glibc setting).
        ``tp_group``: load this rank's shard of a tensor-parallel model (a group of size 1 is none).
        ``context_length``: the longest sequence it will run (default: the model's span; a
        sliding-window model attends over its window past it, see ``windowed``); ``max_context_len``.
        ``kv_cache_dtype``: how its KV pools store K and V (``mem/kv_format.py``; auto: ``dtype``).
        """
        if tune_malloc_arena:
            tune_malloc()
        self.num_threads = configure_threads(num_threads)
        self.model_path = model_path
        self.dtype = resolve_dtype(dtype)
        self.kv_format = kv_format(kv_cache_dtype, self.dtype)
        t0 = time.perf_counter()
        self.tp = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.quantization = resolve_quantization(check_quantization(quantization), model_path)
        in_blocks = self.quantization == "gguf"
        if quant_max_rows is None:
            quant_max_rows = default_max_rows(self.dtype, in_blocks)
        self.quant_max_rows = quant_max_rows
        # int8/int4 copies are cut from the float32 weights, then the model is cast
        load_dtype = torch.float32 if self.quantization in ("int8", "int4") else self.dtype
        config, state = load_model(model_path, load_dtype, progress=progress, keep_blocks=in_blocks)
        if self.tp is not None:
            check_tp_size(config, self.tp.size)
        config, self.context_len = windowed(config, context_length)
        self.model = LlamaForCausalLM.from_state_dict(
            config, state, load_dtype, attention_backend, self.tp, self.context_len
        )
        del state
        self.model.set_block_rows(quant_max_rows)
        self.quantized_linears = self._quantize(quant_max_rows, quant_kernel)
        if self.model.dtype != self.dtype:
            self.model.cast_(self.dtype)
        # a bfloat16 model's decode rows on AMX int8: one kernel for a request's rows and its drafts
        self.tiled_linears = self.model.pack_block_tiles() if self.dtype == torch.bfloat16 and in_blocks else 0
        self.packed_linears = self.model.pack_linears(drop_plain_weights=True) if pack_weights else 0
        from radixserve.model.gguf_file import clear_gguf_cache, open_gguf

        # The tokenizer is built on first use (``tokenizer``): a scheduler process starts with the
        # stop ids alone, read from the file's metadata, and builds it once it has reported ready.
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        kind, path = resolve_model_path(model_path)
        if kind == "gguf":
            self.stop_token_ids = gguf_stop_token_ids(open_gguf(path).metadata)
            open_gguf(path).release_pages()  # the copied parts' pages leave the resident memory
        else:
            self.stop_token_ids = list(self.tokenizer.stop_token_ids)
        clear_gguf_cache()  # done with the file's parse
        self.sampler = Sampler(seed)
        self.kv_pool: KVPool | None = None
        self.req_to_token_pool: ReqToTokenPool | None = None
        self.draft: DraftModel | None = None  # speculative decoding's draft model (use_draft)
        self.load_seconds = time.perf_counter() - t0
        self._log_loaded(config)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, built on first use (thread-safe)."""
        return self.load_tokenizer()

    def load_tokenizer(self) -> Tokenizer:
        """Build the tokenizer unless it is built (``tokenizer``)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from radixserve.model.gguf_file import clear_gguf_cache

                self._tokenizer = Tokenizer.from_model_path(self.model_path)
                clear_gguf_cache()  # the file's parse it read the vocabulary from
            return self._tokenizer

    def _quantize(self, max_rows: int, kernel: str) -> int:
        """The linears in a quantized layout: GGUF blocks, or the int8/int4 copies ``--quantization``
        asks for."""
        if self.quantization in ("int8", "int4"):
            return self.model.quantize_linears(self.quantization, max_rows, kernel)
        return sum(1 for m in self.model.modules() if isinstance(m, Linear) and m.in_blocks)

    def _log_loaded(self, config: ModelConfig) -> None:
        if self.quantization == "gguf":
            q = f"kept in their GGUF blocks ({', '.join(self.block_types())})"
            if self.tiled_linears:
                q += f", {self.tiled_linears} also packed for AMX int8 tiles (decode and verify rows)"
        elif self.quantized_linears:
            q = f"quantized ({self.quantization}, up to {self.quant_max_rows} rows)"
        else:
            q = "quantized"
        logger.info("loaded %s (%s, %d layers) as %s in %.1fs, %d threads, %d linears packed, %d %s; "
                    "weights %.0f MiB", config.name or self.model_path, config.arch, config.num_layers, self.dtype,
                    self.load_seconds, self.num_threads, self.packed_linears, self.quantized_linears, q,
                    self.model.weight_bytes() / 2**20)

    def block_types(self) -> list[str]:
        """The GGUF types the linears read in place, each with how many linears hold it."""
        from gguf.constants import GGMLQuantizationType

        counts: dict[str, int] = {}
        for m in self.model.modules():
            if isinstance(m, Linear) and isinstance(m._quant, GGUFWeight):
                for t in dict.fromkeys(m._quant.type_ids):
                    name = GGMLQuantizationType(t).name
                    counts[name] = counts.get(name, 0) + 1
        return [f"{n} x{k}" for n, k in sorted(counts.items())]

    # ------------------------------------------------------------------ sizes and pools
    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_context_len(self) -> int:
        return self.context_len

    @property
    def tp_size(self) -> int:
        return self.tp.size if self.tp is not None else 1

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank's pool holds: all of them, or its share under tensor parallelism."""
        return self.model_config.num_kv_heads // self.tp_size

    def kv_bytes_per_token(self) -> int:
        """KV bytes a token takes: the target's, plus a draft model's (its pool has the same slots)."""
        c = self.model_config
        own = KVPool.bytes_per_token(c.num_layers, self.local_kv_heads, c.head_dim, self.kv_format)
        return own + (self.draft.kv_bytes_per_token() if self.draft is not None else 0)

    def use_draft(self, args: ModelOptions) -> None:
        """Load the draft model ``--speculative-algorithm draft`` asks for (once: a runner reused by
        another engine keeps it), or drop an earlier one for any other setting; before
        ``attach_pools``. ``--speculative-draft-model-path``, by default the target's own file, is
        read with its GGUF blocks in place (``--quantization auto``) in the target's dtype."""
        if (getattr(args, "speculative_algorithm", None) or "").lower() not in DRAFT_MODEL_ALGORITHMS:
            self.draft = None
            return
        if self.draft is not None:
            return
        # under tensor parallelism the draft runs whole on rank 0 (it is small), before the step is
        # sent: the other ranks verify the drafts it wrote into the step's input ids
        path = getattr(args, "speculative_draft_model_path", None) or args.model_path
        logger.info("loading the draft model %s", path or "(the bundled model)")
        draft = ModelRunner(path, dtype=self.dtype, attention_backend=args.attention_backend,
                            num_threads=args.num_threads, quantization="auto", progress=False,
                            context_length=self.max_context_len, kv_cache_dtype=args.kv_cache_dtype)
        if draft.model_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.model_config.vocab_size} tokens) is not the "
                             f"target's ({self.model_config.vocab_size})")
        self.draft = DraftModel(draft)

    def use_kv_cache_dtype(self, name: str) -> None:
        """Store K and V as ``--kv-cache-dtype name`` says in the pools made from now on (before
        ``attach_pools``; a runner shared by engines takes each engine's)."""
        self.kv_format = kv_format(name, self.dtype)

    def kv_written(self, slots: list[int], tokens: list[int]) -> None:
        """KV of ``tokens`` was written into ``slots`` of the pool from outside a forward (a prefill
        worker's transfer): a draft model lacks those positions and reads them before drafting."""
        if self.draft is not None:
            self.draft.target_wrote(slots, tokens)

    def kv_identity(self) -> bytes:
        """Names the KV this runner computes (the model, its dtype and weight format, the KV layout):
        KV stored under one identity is only ever read back under the same (the KV tier)."""
        c = self.model_config
        return model_identity(self.model_path, "kv-v1", str(self.dtype), self.kv_format.name, self.quantization,
                              c.num_layers, self.local_kv_heads, c.head_dim, self.tp.rank if self.tp is not None else 0)

    def make_kv_pool(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> KVPool:
        c = self.model_config
        return KVPool(size, page_size, c.num_layers, self.local_kv_heads, c.head_dim, self.kv_format, device)

    def make_req_to_token_pool(self, size: int, max_context_len: int | None = None) -> ReqToTokenPool:
        return ReqToTokenPool(size, max_context_len or self.max_context_len)

    def attach_pools(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> None:
        c = self.model_config
        if kv_pool.num_layers != c.num_layers:
            raise ValueError(f"KV pool has {kv_pool.num_layers} layers, the model {c.num_layers}")
        k0 = kv_pool.k_buffers[0]
        if tuple(k0.shape[1:]) != (self.local_kv_heads, c.head_dim):
            raise ValueError(
                f"KV pool rows are {tuple(k0.shape[1:])}, the model needs {(self.local_kv_heads, c.head_dim)}"
            )
        if self.tp is not None and self.tp.rank == 0:
            if not isinstance(req_to_token_pool, JournaledReqToTokenPool):
                raise TypeError("tensor parallelism: rank 0 needs a JournaledReqToTokenPool (build_scheduler)")
            # the other ranks build the same pools from these sizes (tp_worker.serve_tp_rank)
            sizes = (kv_pool.size, kv_pool.page_size, req_to_token_pool.size, req_to_token_pool.max_context_len)
            self.tp.broadcast_(torch.tensor(sizes, dtype=torch.int64).to(self.tp.device))
            req_to_token_pool.take_journal()  # the table starts empty on every rank
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        if self.draft is not None:
            self.draft.attach(kv_pool)

    # ------------------------------------------------------------------ the step
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.kv_pool is None or self.req_to_token_pool is None:
            raise RuntimeError("ModelRunner.forward before attach_pools()")
        if self.tp is not None:
            return self._forward_tp(batch)
        return self._forward_local(batch)

    def _forward_local(self, batch: ForwardBatch) -> ForwardOutput:
        assert self.kv_pool is not None and self.req_to_token_pool is not None
        with torch.inference_mode():
            if self.draft is not None:
                self.draft.before_target(batch, self.req_to_token_pool)
            elif batch.verify is not None and batch.verify.by_runner:
                raise RuntimeError("the step asks for a draft model's drafts, and this runner has none")
            logits = self.model(batch, self.kv_pool, self.req_to_token_pool).float()
            return self._sample(batch, logits)

    def _sample(self, batch: ForwardBatch, logits: torch.Tensor) -> ForwardOutput:
        """(Called in inference mode.)"""
        extra = drafts = None
        B = batch.batch_size
        info = batch.sampling
        if batch.verify is not None:
            n = len(batch.verify.positions)
            logits, drafts = logits[: logits.shape[0] - n], logits[logits.shape[0] - n :]
            if info.grammars is not None:  # verify rows' matchers follow their kept tokens (spec_verify)
                rows = set(batch.verify.rows)
                info = replace(info, grammars=[None if i in rows else m for i, m in enumerate(info.grammars)])
        if batch.prompt_logprobs is not None:
            logits, extra = logits[:B], logits[B:]
        sampled = self.sampler.sample(logits, info)
        out = ForwardOutput(
            next_token_ids=sampled.next_token_ids,
            logprobs=sampled.logprobs,
            top_logprobs=sampled.top_logprobs,
            logits=logits if batch.capture_logits else None,
            grammar_ended=sampled.grammar_ended,
        )
        if drafts is not None and batch.verify is not None:
            out.verified, ended, paths = verify_drafts(logits, drafts, batch.verify, batch.sampling,
                                                       self.sampler.generator)
            if batch.verify.parents is not None:
                out.verify_paths = paths
            if ended:
                out.grammar_ended = {**(out.grammar_ended or {}), **ended}
            if out.logprobs is not None or out.top_logprobs is not None:
                out.verified_logprobs, out.verified_top_logprobs = verified_logprobs(
                    logits, drafts, batch.verify, out.verified, paths, info.top_logprobs_nums or [],
                    out.logprobs is not None)
            if batch.verify.by_runner:
                out.drafts = batch.verify.drafts
        if extra is not None and batch.prompt_logprobs is not None:
            out.prompt_logprobs = PromptLogprobs(batch.prompt_logprobs, *prompt_logprobs(extra, batch.prompt_logprobs))
        return out

    # ------------------------------------------------------------------ tensor parallelism
    def _forward_tp(self, batch: ForwardBatch) -> ForwardOutput:
        """Rank 0: broadcast the step, run this rank's shard (its collectives join the other ranks'),
        sample from the gathered logits. The sampled ids reach the other ranks as the input ids of
        the next step's broadcast: they never sample."""
        tp = self.tp
        assert tp is not None and self.kv_pool is not None
        assert isinstance(self.req_to_token_pool, JournaledReqToTokenPool)
        if tp.broken is not None:  # a group that lost a rank cannot recover: fail every later step too
            raise RuntimeError(f"the tensor-parallel group is broken: {tp.broken}")
        try:
            with torch.inference_mode():
                if self.draft is not None:  # the drafts go into the input ids the other ranks get
                    self.draft.before_target(batch, self.req_to_token_pool)
                elif batch.verify is not None and batch.verify.by_runner:
                    raise RuntimeError("the step asks for a draft model's drafts, and this runner has none")
            send_step(tp, batch, self.req_to_token_pool.take_journal())
            with torch.inference_mode():
                logits = self.model(batch, self.kv_pool, self.req_to_token_pool).float()
        except Exception as e:  # a step failed half-way leaves the other ranks inside a collective
            tp.broken = e
            raise
        with torch.inference_mode():
            return self._sample(batch, logits)

    def shutdown(self) -> None:
        """Rank 0 under tensor parallelism: tell the other ranks to exit, then leave the group."""
        tp, self.tp = self.tp, None
        if tp is None:
            return
        if tp.rank == 0 and tp.broken is None:
            try:
                send_stop(tp)
            except Exception:  # a rank already gone: the others see its connection close
                logger.debug("could not send stop to the tensor-parallel ranks", exc_info=True)
        tp.destroy()
