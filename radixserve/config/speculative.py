"""The speculative decoding area of ``ServerArgs`` (SGLang's option names; docs/speculative.md)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import not_positive, option

SPECULATIVE_ALGORITHMS = ("ngram", "draft", "NGRAM", "STANDALONE")
DRAFT_MODEL_ALGORITHMS = ("draft", "standalone")  # (lower-cased) the ones with a draft model


@dataclass(frozen=True)
class SpeculativeOptions:
    speculative_algorithm: str | None = option(
        None, "Speculative decoding. ngram: a decoding request proposes the tokens that followed the "
        "longest earlier occurrence of its last tokens in its own prompt and output, and the model checks "
        "them in the same forward; the kept tokens are exactly what decoding without it gives (greedy), or "
        "distributed as it (sampling, by rejection sampling). Pays where outputs repeat their input "
        "(summaries, edits, extraction, code); costs nothing where nothing matches. draft (SGLang's "
        "STANDALONE): a draft model (--speculative-draft-model-path) proposes the tokens, one forward each. "
        "Off by default.", SPECULATIVE_ALGORITHMS, group="speculative")
    speculative_draft_model_path: str | None = option(
        None, "With --speculative-algorithm draft: the draft model, a GGUF file or model directory with the "
        "target's vocabulary. Default: the target's own file with its GGUF blocks read in place (a cheap draft "
        "of a target run with --quantization none).", group="speculative")
    speculative_num_draft_tokens: int = option(
        8, "With --speculative-algorithm: the most draft tokens one request verifies in a step (each "
        "request's own draft length follows its acceptance, up to this). SGLang's --speculative-num-steps "
        "is the same option here (one draft token per draft step).", group="speculative",
        aliases=("--speculative-num-steps",))
    speculative_ngram_min_match_window_size: int = option(
        1, "ngram: the fewest last tokens that must match an earlier occurrence to draft from it.",
        group="speculative")
    speculative_ngram_max_match_window_size: int = option(
        12, "ngram: the longest match looked for (the longest match wins, the latest on a tie).",
        group="speculative")
    speculative_ngram_max_bfs_breadth: int = option(
        3, "ngram: the most earlier matches a request drafts from at once. Their continuations form a "
        "tree (continuations that agree share their tokens) verified in one forward, each token attended "
        "as the decode step of its own path; the longest accepted path is kept. 1: one chain. Trees need "
        "--page-size 1 (a larger page size drafts chains).", group="speculative")
    speculative_max_batch_size: int = option(
        4, "With --speculative-algorithm: steps with more running requests than this draft nothing "
        "(a CPU step's cost grows with its tokens, and a full batch has no compute to spare for drafts).",
        group="speculative")

    def _speculative_errors(self) -> list[str]:
        errors: list[str] = []
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size", "speculative_ngram_max_bfs_breadth",
                     "speculative_max_batch_size"):
            errors += not_positive(self, name, allow_none=False)
        if self.speculative_draft_model_path and (self.speculative_algorithm or "").lower() not in DRAFT_MODEL_ALGORITHMS:
            errors.append("--speculative-draft-model-path needs --speculative-algorithm draft")
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            errors.append("speculative_ngram_max_match_window_size must be at least "
                          "speculative_ngram_min_match_window_size")
        return errors
