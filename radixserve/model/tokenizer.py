"""Text <-> token ids, and chat prompts, for the loaded model.

Built with the ``tokenizers`` library either from a GGUF file's metadata or from ``tokenizer.json``
in a checkpoint directory. The chat template is rendered with a sandboxed jinja2 environment set up
like transformers' one. A GGUF file holds one of two kinds:

- ``gpt2``: byte-level BPE (Llama 3, Qwen, SmolLM2): the tokens and the merges are in the file;
- ``llama``: SentencePiece (Llama 2, Mistral, Phi-3, Gemma): pieces with scores, no merges. llama.cpp
  encodes by merging, again and again, the adjacent pair whose union is the piece of highest score,
  with characters outside the vocabulary as ``<0xXX>`` byte pieces. A BPE whose merges are ranked
  by the score of the piece they make does the same, so the merges are derived from the scores
  (``gguf_tokenizer._spm_merges``), spaces become ``▁``, and the text gets the leading ``▁`` where
  ``tokenizer.ggml.add_space_prefix`` (default true) asks for it: before the text and after every
  special token, as llama.cpp writes it.

The GGUF pre-tokenizer follows ``tokenizer.ggml.pre`` the way llama.cpp does. For ``smollm`` (and
the other StarCoder-style vocabularies) digits are split off one by one before the GPT-2 regex, as
in the original SmolLM2 ``tokenizer.json``. NOTE: transformers' own GGUF conversion (5.x) ignores
``pre == "smollm"`` and uses the plain GPT-2 regex; the two only differ when a run of two or more
spaces precedes a digit (``"a  1"``), where this tokenizer gives what the model was trained on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from radixserve.model.gguf_tokenizer import (
    gpt2_backend,
    opt_int,
    piece_bytes,
    spm_backend,
    unicode_to_bytes,
)

# Tokens that end a turn in common chat templates: a stop token when the template writes it.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
)
_FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(Exception):
    pass


def _turn_end_ids(template: str | None, token_to_id: Callable[[str], int | None]) -> list[int]:
    """The end-of-turn tokens ``template`` writes: each is a stop token."""
    ids = [token_to_id(tok) for tok in _END_OF_TURN_TOKENS if tok in (template or "")]
    return [int(t) for t in ids if t is not None]


def stop_token_ids(eos_token_id: int | None, template: str | None, extra: Iterable[int],
                   token_to_id: Callable[[str], int | None]) -> list[int]:
    """A model's stop tokens, each once: its EOS, the end-of-turn tokens its chat template writes,
    and the further ones its files name (EOT, generation_config's EOS list)."""
    stops: list[int] = [] if eos_token_id is None else [eos_token_id]
    for tid in [*_turn_end_ids(template, token_to_id), *extra]:
        if tid not in stops:
            stops.append(int(tid))
    return stops


def gguf_stop_token_ids(meta: dict[str, Any]) -> list[int]:
    """``Tokenizer.from_gguf_metadata(meta).stop_token_ids`` without building the tokenizer (a
    scheduler needs only these to start). A token's id is its place in the file's vocabulary, the
    last place if it is there twice, as the tokenizer's vocabulary has it."""
    wanted = set(_END_OF_TURN_TOKENS)
    places = {tok: i for i, tok in enumerate(meta.get("tokenizer.ggml.tokens") or []) if tok in wanted}
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return stop_token_ids(opt_int(meta.get("tokenizer.ggml.eos_token_id")), meta.get("tokenizer.chat_template"),
                          [int(eot)] if eot is not None else [], places.get)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_stop_token_ids: Iterable[int] = (),
        byte_level: bool = True,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.byte_level = byte_level
        self.bos_token = backend.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = backend.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.stop_token_ids: list[int] = stop_token_ids(eos_token_id, chat_template, extra_stop_token_ids,
                                                        backend.token_to_id)
        self.special_token_ids: frozenset[int] = frozenset(
            int(tid) for tid, added in backend.get_added_tokens_decoder().items() if added.special
        )
        self._piece_bytes: list[bytes] | None = None  # SentencePiece from GGUF: each token's bytes
        self._strip_space = False  # ... and the leading space its decoding drops

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_model_path(cls, path: str | None) -> Tokenizer:
        """The tokenizer of the model ``load_model(path)`` loads (None: the bundled SmolLM2)."""
        from radixserve.model.loader import resolve_model_path

        kind, resolved = resolve_model_path(path)
        return cls.from_gguf(resolved) if kind == "gguf" else cls.from_pretrained_dir(resolved)

    @classmethod
    def from_gguf(cls, path: str, metadata: dict[str, Any] | None = None) -> Tokenizer:
        if metadata is None:
            from radixserve.model.gguf_file import read_gguf_metadata

            metadata = read_gguf_metadata(path)
        return cls.from_gguf_metadata(metadata)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(meta)
        if kind != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and SentencePiece "
                "'llama' are); use a checkpoint directory with tokenizer.json instead"
            )
        backend = gpt2_backend(meta)
        return cls(
            backend,
            bos_token_id=opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            extra_stop_token_ids=[int(x) for x in [meta.get("tokenizer.ggml.eot_token_id")] if x is not None],
            byte_level=True,
        )

    @classmethod
    def _from_gguf_spm(cls, meta: dict[str, Any]) -> Tokenizer:
        backend, pieces, space_prefix = spm_backend(meta)
        eot = meta.get("tokenizer.ggml.eot_token_id")
        tok = cls(
            backend,
            bos_token_id=opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            extra_stop_token_ids=[int(eot)] if eot is not None else [],
            byte_level=False,
        )
        # decoding joins each piece's bytes, as llama.cpp and SentencePiece do: tokenizers'
        # ByteFallback turns every byte of an invalid UTF-8 run into U+FFFD, valid bytes among them too
        tok._piece_bytes = pieces
        tok._strip_space = space_prefix
        return tok

    @classmethod
    def from_pretrained_dir(cls, directory: str) -> Tokenizer:
        tok_path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = BackendTokenizer.from_file(tok_path)
        tcfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(directory, "config.json"))
        gcfg = _read_json(os.path.join(directory, "generation_config.json"))

        def token_id(entry: Any) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        bos = token_id(tcfg.get("bos_token"))
        if bos is None:
            bos = opt_int(mcfg.get("bos_token_id"))
        eos = token_id(tcfg.get("eos_token"))
        if eos is None:
            cfg_eos = mcfg.get("eos_token_id")
            eos = opt_int(cfg_eos[0] if isinstance(cfg_eos, list) and cfg_eos else cfg_eos)
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        extra: list[int] = []
        for cfg in (gcfg, mcfg):
            e = cfg.get("eos_token_id")
            extra += [int(x) for x in (e if isinstance(e, list) else [e]) if x is not None]
        byte_level = "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            chat_template=template,
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
            extra_stop_token_ids=extra,
            byte_level=byte_level,
        )

    def use_chat_template(self, template: str | None) -> Tokenizer:
        """Replace the model's chat template (``--chat-template``): a file's path, or the template
        text itself; checked by compiling it. None keeps the model's. Returns self."""
        if template is None:
            return self
        if os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        elif "{{" not in template and "{%" not in template:
            raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template")
        try:
            _compile_template(template)
        except Exception as e:  # jinja2's TemplateSyntaxError, with the line it failed on
            raise ValueError(f"--chat-template does not compile: {e}") from e
        self.chat_template = template
        turn_ends = _turn_end_ids(template, self.backend.token_to_id)
        self.stop_token_ids += [t for t in turn_ends if t not in self.stop_token_ids]
        return self

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        ``add_special_tokens`` only adds BOS where the model asks for it (``add_bos_token``).
        """
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._piece_bytes is None:
            return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        table, special, n = self._piece_bytes, self.special_token_ids, len(self._piece_bytes)
        # ids past the tokenizer's own (a model's padded vocabulary rows) stand for nothing
        data = b"".join(table[i] for i in ids if i < n and not (skip_special_tokens and i in special))
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self._strip_space and text.startswith(" ") else text

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (special tokens: their text)."""
        tok = self.backend.id_to_token(token_id)
        if tok is None:
            return b""
        if token_id in self.special_token_ids:
            return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._piece_bytes is not None:
            return self._piece_bytes[token_id]
        if not self.byte_level:
            return piece_bytes(tok)
        table = unicode_to_bytes()
        try:
            return bytes(table[c] for c in tok)
        except KeyError:
            return tok.encode("utf-8")

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own template."""
        template = _compile_template(self.chat_template or _FALLBACK_CHAT_TEMPLATE)
        return str(
            template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Chat prompt ids. The template writes BOS itself where the model wants one."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
