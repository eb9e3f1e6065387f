"""Tokenizers from a GGUF file's metadata (``Tokenizer.from_gguf_metadata`` wraps them).

- ``gpt2``: byte-level BPE (Llama 3, Qwen, SmolLM2): the tokens and the merges are in the file; the
  pre-tokenizer follows ``tokenizer.ggml.pre`` the way llama.cpp does (for ``smollm`` and the other
  StarCoder-style vocabularies digits are split off one by one before the GPT-2 regex).
- ``llama``: SentencePiece (Llama 2, Mistral, Phi-3, Gemma): pieces with scores, no merges, see
  ``tokenizer.py``'s docstring for why merges ranked by score reproduce llama.cpp's encoding.
"""

from __future__ import annotations

from functools import lru_cache
from operator import methodcaller
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp pre-tokenizer names -> how to split text before byte-level BPE.
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def gpt2_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """Byte-level BPE from the file's tokens and merges, pre-tokenized as ``tokenizer.ggml.pre`` says."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(map(tuple, map(methodcaller("split", " ", 1), meta.get("tokenizer.ggml.merges") or [])))
    alphabet = set(bytes_to_unicode().values())
    byte_map = bytes_to_unicode()
    # A token spelled outside the byte alphabet is respelled byte-wise (as transformers does); most
    # vocabularies have none, which one look at all their characters tells (a sixth of the time).
    spelled = tokens if set("".join(tokens)) <= alphabet else [
        t if set(t) <= alphabet else "".join(byte_map[b] for b in t.encode("utf-8")) for t in tokens
    ]
    vocab = dict(zip(spelled, range(len(spelled)), strict=True))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre in _DIGITS_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, tt in zip(tokens, token_types, strict=True)
        if tt == 3 and set(tok) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, tt in zip(spelled, token_types, strict=True)
        if tt == 4
    ]
    if user:
        backend.add_tokens(user)
    return backend


def spm_backend(meta: dict[str, Any]) -> tuple[BackendTokenizer, list[bytes], bool]:
    """SentencePiece as a BPE whose merges come from the piece scores; also each piece's bytes (what
    decoding joins) and whether the text gets a leading space."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    scores: list[float] = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = opt_int(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), unk_token=unk,
                   fuse_unk=True, byte_fallback=True)
    )
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(parts)
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=True)
               if k == _CONTROL]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return backend, [piece_bytes(t) for t in tokens], space_prefix


# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: a byte piece's byte, else its text with ▁ for
    the spaces."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("▁", " ").encode("utf-8")


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging: every split of a normal
    piece into two pieces of the vocabulary, the merges of higher-scoring pieces first."""
    index = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = index.get(left), index.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[i], i, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
