"""How far weight-only quantization moves the model's predictions (``--quantization``).

    python -m radixserve.bench.quant_quality [--methods int8 int4] [--dtype float32]

Teacher-forced on English text: every position of each passage is one next-token prediction. For
each method it reports, against the same model with its float weights,

- top-1 agreement: the share of positions whose most likely next token is the same (a greedy
  decode stays on the float model's path while this holds);
- the mean KL divergence of the float distribution to the quantized one, in nats;
- the largest logit error relative to the largest float logit, per position (worst position).

One model is loaded; each method's quantized copies are swapped into its linears in turn and used for
every row (``max_rows`` unbounded), so the prefill here runs the same kernels decode runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib.resources import files

import torch

from radixserve.mem.forward_batch import ForwardBatch, SamplingBatchInfo
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.linear import Linear
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.quant import QuantizedWeight

# Short passages of plain English prose, instructions and code (written for this test).
PASSAGES = (
    "The river runs slowly past the old mill, where the children of the village used to gather every "
    "summer evening to watch the swallows dive over the water and tell each other stories about the war.",
    "To make a simple bread, mix flour, water, salt and a little yeast, knead the dough for ten minutes, "
    "let it rise for an hour in a warm place, shape it into a loaf and bake it until the crust is brown.",
    "Photosynthesis is the process by which green plants use sunlight to turn carbon dioxide and water "
    "into glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "Dear Ms. Patel, thank you for your letter of March the fourth. I am writing to confirm that the "
    "meeting will take place on Tuesday at ten o'clock in the main conference room on the second floor.",
    "The first law of thermodynamics states that energy cannot be created or destroyed, only changed from "
    "one form to another. The second law says that the entropy of an isolated system never decreases.",
    "When the train finally stopped, nobody moved. Outside, the snow had covered the platform and the "
    "station lights were off. The conductor walked along the corridor and told us to stay in our seats.",
    "A good password is long, hard to guess and different for every account. Use a password manager to "
    "remember them, and turn on two-factor authentication wherever a service offers it.",
)


def shipped_text() -> str:
    """The grounded-workload text and the passages above: prose, instructions and code written for
    these benchmarks (~780 tokens)."""
    return files("radixserve.bench").joinpath("data/grounded.txt").read_text() + "\n\n" + "\n\n".join(PASSAGES)


@dataclass
class Quality:
    method: str
    positions: int
    top1_agreement: float
    mean_kl: float
    max_rel_logit_error: float


def _set_quant(model: LlamaForCausalLM, method: str) -> None:
    """Swap ``method``'s copies into every linear (quantizing once per method), or take them all out
    (``none``). They serve inputs of any size, prefill included. ``method`` may name its kernel
    (``int4:aten``, ``int4:block``; quant.py ``quantize_weight``)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    cache: dict[str, list[QuantizedWeight | None]] = model.__dict__.setdefault("_quality_copies", {})
    if method != "none" and method not in cache:
        name, _, kernel = method.partition(":")
        model.quantize_linears(name, max_rows=1 << 30, kernel=kernel or "auto")
        cache[method] = [m._quant for m in linears]
    copies = cache.get(method, [None] * len(linears))
    for m, q in zip(linears, copies, strict=True):
        m._quant, m.quant_max_rows = q, (1 << 30 if q is not None else 0)


@torch.inference_mode()
def all_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of the next token at every position (one prefill)."""
    c = model.config
    n = len(ids)
    kv = KVPool(n, 1, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
    r2t = ReqToTokenPool(1, n)
    slots = list(range(1, n + 1))  # slot 0 is the pool's padding row
    row = r2t.alloc()
    assert row is not None
    r2t.write(row, 0, slots)
    fb = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.arange(n),
        out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        req_pool_indices=torch.tensor([row], dtype=torch.int64),
        seq_lens=torch.tensor([n]),
        extend_prefix_lens=[0],
        extend_seq_lens=[n],
        sampling=SamplingBatchInfo.greedy(1),
    )
    hidden = model.forward_hidden(fb, kv, r2t)
    return model.lm_head(model.norm(hidden)).float()


def measure(model: LlamaForCausalLM, texts: list[list[int]], methods: list[str]) -> list[Quality]:
    _set_quant(model, "none")
    refs = [all_logits(model, ids) for ids in texts]
    out = []
    for method in methods:
        _set_quant(model, method)
        agree = total = 0
        kl_sum = 0.0
        worst = 0.0
        for ids, ref in zip(texts, refs, strict=True):
            got = all_logits(model, ids)
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(ids)
            lp_ref, lp_got = ref.log_softmax(-1), got.log_softmax(-1)
            kl_sum += float((lp_ref.exp() * (lp_ref - lp_got)).sum())
            rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
            worst = max(worst, float(rel.max()))
        out.append(Quality(method, total, agree / total, kl_sum / total, worst))
    _set_quant(model, "none")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="Model (default: the bundled SmolLM2).")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["int8", "int4"],
                    help="int8 or int4, each optionally :block or :aten (the kernel; default: this CPU's choice)")
    args = ap.parse_args(argv)
    from radixserve.model.loader import load_model, parse_dtype
    from radixserve.model.tokenizer import Tokenizer

    dtype = parse_dtype(args.dtype)
    config, state = load_model(args.model_path, dtype, progress=False)
    model = LlamaForCausalLM.from_state_dict(config, state, dtype, "torch_native")
    del state
    tok = Tokenizer.from_model_path(args.model_path)
    texts = [tok.encode(p) for p in PASSAGES]
    print(f"{len(texts)} passages, {sum(map(len, texts))} positions, {args.dtype} activations and reference")
    print(f"{'method':>10} {'top-1 agreement':>16} {'mean KL (nats)':>15} {'max rel logit err':>18}")
    for q in measure(model, texts, args.methods):
        print(f"{q.method:>10} {q.top1_agreement:>16.4f} {q.mean_kl:>15.5f} {q.max_rel_logit_error:>18.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
