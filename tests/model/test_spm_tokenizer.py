"""SentencePiece tokenizers in GGUF files (``tokenizer.ggml.model == "llama"``): token for token
equal to the ``sentencepiece`` library on the model it was made from (multilingual, code,
whitespace runs, characters only byte pieces can spell, random strings), and to transformers'
reading of the same GGUF but where a text starts with a space (there transformers leaves out the
leading "▁" that SentencePiece and llama.cpp write); llama.cpp's space after special tokens;
decoding, byte pieces, and streaming a character that spans several byte pieces."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest

from radixserve.model.detokenize import IncrementalDetokenizer
from radixserve.model.tokenizer import Tokenizer, gguf_stop_token_ids

spm = pytest.importorskip("sentencepiece")

CORPUS = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci !
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München.
El veloz murciélago hindú comía feliz cardillo y kiwi. ¿Dónde está la biblioteca?
敏捷的棕色狐狸跳过了懒狗。 你好，世界！ 日本語のテキストも少し。
Быстрая коричневая лиса прыгает через ленивую собаку.
    indented    text   with   many     spaces\t\tand tabs
for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }
"""
TEXTS = [*CORPUS.splitlines(), "  leading spaces", "trailing  ", "\n\nnewlines\n", "emoji 😀 and ẞ unseen ŋ",
         "12345 digits 3.14159", "x" * 50, "   ", "", "a\tb\t\tc", "mixed 中文 and English", "ñandú pingüino"]
TYPES = {"normal": 1, "unknown": 2, "control": 3, "user": 4, "unused": 5, "byte": 6}


def train(space_prefix: bool) -> Any:
    """A byte-fallback BPE model as Llama 2's was trained (identity normalization, whitespace kept)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 20), model_writer=model, vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, hard_vocab_limit=False, character_coverage=1.0,
        add_dummy_prefix=space_prefix, user_defined_symbols=["<|im_start|>"], control_symbols=["<|im_end|>"],
        minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_metadata(sp: Any, space_prefix: bool) -> dict[str, Any]:
    """What llama.cpp's converter writes for a SentencePiece model."""
    def kind(i: int) -> int:
        for name, test in (("unknown", sp.is_unknown), ("control", sp.is_control), ("byte", sp.is_byte),
                           ("unused", sp.is_unused)):
            if test(i):
                return TYPES[name]
        return TYPES["user"] if sp.id_to_piece(i) == "<|im_start|>" else TYPES["normal"]

    n = sp.get_piece_size()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": space_prefix,
    }


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def pair(request: Any) -> tuple[Any, Tokenizer, dict[str, Any]]:
    sp = train(request.param)
    meta = gguf_metadata(sp, request.param)
    return sp, Tokenizer.from_gguf_metadata(meta), meta


def test_encode_and_decode_equal_sentencepiece(pair: tuple[Any, Tokenizer, dict[str, Any]]) -> None:
    sp, tok, _ = pair
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text
    # some of those texts need byte pieces: the fallback really ran
    assert any(tok.id_to_token(i).startswith("<0x") for i in tok.encode("😀 ŋ", add_special_tokens=False))


def test_random_strings_equal_sentencepiece(pair: tuple[Any, Tokenizer, dict[str, Any]]) -> None:
    sp, tok, _ = pair
    rng = random.Random(0)
    chars = sorted(set(CORPUS)) + list("😀ŋẞ\u00a0\u3000")
    lines = CORPUS.splitlines()
    for _ in range(2000):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.5:  # mostly-seen text, cut at a random place
            line = rng.choice(lines)
            text = line[rng.randrange(len(line)):] + text[:5]
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), repr(text)


def test_special_tokens_bos_and_token_bytes(pair: tuple[Any, Tokenizer, dict[str, Any]]) -> None:
    sp, tok, meta = pair
    start, end = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    # special tokens written in the text stay whole; the text after one starts a new piece
    # sequence with its own leading space where the model has one, as llama.cpp writes it
    assert tok.encode("<|im_start|>user hi<|im_end|>", add_special_tokens=False) == \
        [start, *sp.encode("user hi"), end]
    assert tok.encode("hello")[0] == sp.bos_id()  # SentencePiece models add BOS unless the file says not
    assert Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": False}).encode("hello") == \
        sp.encode("hello")
    assert tok.eos_token_id == sp.eos_id() and sp.eos_id() in tok.stop_token_ids
    # the bytes each piece stands for: byte pieces are their byte, ▁ is a space
    assert tok.token_bytes(sp.piece_to_id("<0xE2>")) == b"\xe2"
    word = next(i for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith("▁") and len(sp.id_to_piece(i)) > 2)
    assert tok.token_bytes(word) == sp.id_to_piece(word).replace("▁", " ").encode()
    text = "Grüße, 敏捷 😀 ŋ!"
    ids = tok.encode(text, add_special_tokens=False)
    joined = b"".join(tok.token_bytes(i) for i in ids).decode()
    assert joined.removeprefix(" ") == text


def test_streaming_never_splits_a_character(pair: tuple[Any, Tokenizer, dict[str, Any]]) -> None:
    _, tok, _ = pair
    text = "a 😀 ŋ 中文 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.feed([i]) for i in ids[:-1]] + [detok.feed(ids[-1:], finished=True)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_a_gguf_file_loads_the_same_tokenizer_as_transformers(tmp_path: Any) -> None:
    """The tokenizer written into a GGUF model file: ours and transformers' reading of it agree."""
    transformers = pytest.importorskip("transformers")
    from tests.model.tiny_models import make_tiny_model, write_gguf

    sp = train(True)
    meta = gguf_metadata(sp, True)
    d = make_tiny_model(str(tmp_path / "hf"), "mixtral")
    path = write_gguf(d, str(tmp_path / "model.gguf"), tokenizer=meta)
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    differ = []
    for text in TEXTS:
        assert ours.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        if ours.encode(text) != theirs.encode(text):
            differ.append(text)
    # transformers' Metaspace adds no leading "▁" to a text that starts with a space; SentencePiece
    # and llama.cpp always add it. Everywhere else the two agree.
    assert differ and all(t[:1] == " " for t in differ)


def test_engine_serves_a_gguf_model_with_a_sentencepiece_tokenizer(tmp_path: Any) -> None:
    from radixserve.engine import Engine
    from tests.model.tiny_models import make_tiny_model, write_gguf

    sp = train(True)
    d = make_tiny_model(str(tmp_path / "hf"), "qwen3_moe", vocab_size=sp.get_piece_size())
    path = write_gguf(d, str(tmp_path / "model.gguf"), tokenizer=gguf_metadata(sp, True))
    with Engine(path, dtype="float32", max_total_tokens=1024) as eng:
        prompts = ["Grüße aus München", "def fibonacci(n):"]
        outs = eng.generate(prompts, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        assert isinstance(outs, list)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out["meta_info"]["prompt_tokens"] == 1 + len(sp.encode(prompt))  # BOS + the pieces
            assert len(out["output_ids"]) == 12
            assert out["text"] == sp.decode(out["output_ids"])
        eng.check_memory_invariant()


def test_stop_ids_read_without_building_the_tokenizer(pair: tuple[Any, Tokenizer, dict[str, Any]]) -> None:
    sp, tok, meta = pair
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    for variant in (meta, {**meta, "tokenizer.chat_template": template, "tokenizer.ggml.eot_token_id": 5}):
        assert gguf_stop_token_ids(variant) == Tokenizer.from_gguf_metadata(variant).stop_token_ids
    assert sp.piece_to_id("<|im_end|>") in gguf_stop_token_ids({**meta, "tokenizer.chat_template": template})
