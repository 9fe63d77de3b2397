"""The tokenizer of an HF model directory: ids, text, chat template, and streaming detokenization.

Reads tokenizer.json (a `tokenizers` Tokenizer), tokenizer_config.json (special tokens, BOS policy,
chat template; or chat_template.jinja beside it) and generation_config.json (end-of-generation ids).
Chat templates render as transformers renders them: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that
keeps non-ASCII text (json_writer.json_dumps: a value of many items is written so that other threads run meanwhile).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.json_writer import json_dumps
from pdserve.weights.hf_dir import GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, read_json

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' clean_up_tokenization: drop the space a word-level decoder put before punctuation.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# How much a normalizer may shorten text, in characters: None for one that may delete any amount. NFC and
# NFKC compose (three conjoining Hangul jamo make one syllable; NFKC maps a fullwidth letter to ASCII,
# three bytes to one, but one character to one), so 4 leaves room; the rest never shorten.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Prepend": 1, "Lowercase": 1}
# Pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop some; Split drops its matches when its behavior is Removed).
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            f = _normalizer_shrink(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a literal pattern replaced by text at least as long
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return 1 if isinstance(pattern, str) and len(content) >= len(pattern) else None
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizers(pre: dict | None) -> list[dict]:
    """The pre-tokenizers of tokenizer.json's `pre_tokenizer`, Sequences opened."""
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [p for inner in pre.get("pretokenizers", []) for p in _pre_tokenizers(inner)]
    return [pre]


def _byte_level_alphabet() -> dict[int, str]:
    """Byte -> the character byte-level BPE spells it with: printable Latin-1 bytes as themselves, the
    others as U+0100 onwards, in byte order (GPT-2's scheme, which tokenizers' ByteLevel follows)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


def _chars_holding(missing: list[int]) -> re.Pattern[str] | None:
    """The characters whose UTF-8 form holds one of the bytes `missing`, as a pattern; None for none.
    ValueError when a continuation byte is missing (it sits in most multi-byte characters)."""
    ranges = []
    for b in missing:
        if b < 0x80:
            ranges.append((b, b))
        elif b < 0xC0:
            raise ValueError(f"continuation byte {b:#x} has no token")
        elif 0xC2 <= b <= 0xDF:  # 0xC0, 0xC1 and 0xF5-0xFF never appear in UTF-8
            ranges.append(((b - 0xC0) << 6, ((b - 0xC0) << 6) + 0x3F))
        elif 0xE0 <= b <= 0xEF:
            ranges.append(((b - 0xE0) << 12, ((b - 0xE0) << 12) + 0xFFF))
        elif 0xF0 <= b <= 0xF4:
            ranges.append(((b - 0xF0) << 18, min(((b - 0xF0) << 18) + 0x3FFFF, 0x10FFFF)))
    if not ranges:
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json_dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _chat_template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return template


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special ids."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None, chat_template: str | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in _SPECIAL_KEYS}
        self.bos_token_id = self.token_to_id(self.special_tokens["bos_token"])
        self.eos_token_ids = self._eos_ids(generation_config or {})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        # Prepend BOS ourselves only when the config asks for it and tokenizer.json's
        # post-processor does not already do so (older Llama repos rely on the Python class).
        marked = backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = (bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
                             and self.bos_token_id not in marked)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        d = Path(model_dir)
        if not (d / TOKENIZER_FILE).is_file():
            raise ValueError(
                f"{d} has no {TOKENIZER_FILE}; pdserve needs the fast-tokenizer file (save the tokenizer with "
                "transformers' save_pretrained, or convert a GGUF with `pdserve convert`)"
            )
        backend = tokenizers.Tokenizer.from_file(str(d / TOKENIZER_FILE))
        config = read_json(d / TOKENIZER_CONFIG_FILE) if (d / TOKENIZER_CONFIG_FILE).is_file() else {}
        generation = read_json(d / GENERATION_CONFIG_FILE) if (d / GENERATION_CONFIG_FILE).is_file() else {}
        return cls(backend, config, generation, _chat_template_source(d, config))

    def _eos_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        gen = generation_config.get("eos_token_id")
        for i in gen if isinstance(gen, list) else [gen]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        tok_eos = self.token_to_id(self.special_tokens["eos_token"])
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return tuple(ids)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def special_token_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """{text: id} of those of `texts` that are special added tokens (which decode leaves out unless told to
        keep them); a text that is no token, or an ordinary one, is not there."""
        ids = {t: self.token_to_id(t) for t in texts}
        return {t: i for t, i in ids.items() if i is not None and i in self.all_special_ids}

    @cached_property
    def _length_bound(self) -> tuple[int, re.Pattern[str] | None] | None:
        """(the most characters one token stands for, the characters the model may drop) where that is
        bounded: a BPE model, a pre-tokenizer that keeps every character and a normalizer that cannot
        delete them (the bound allows for those that compose). A token stands for at most the UTF-8
        bytes of its vocabulary string (a byte-level string spells a byte with one or two), and a
        character is at least one byte. BPE drops a character it has no token for unless byte fallback
        or an unfused unknown token catches it; a byte-level vocabulary that lacks some bytes drops the
        characters that hold them, which the bound then leaves out. None where one token may stand for
        any amount of text (WordPiece and Unigram map an unknown run to one token; a fused unknown
        token; a normalizer that deletes)."""
        spec = json.loads(self.backend.to_str())
        model, pres = spec.get("model") or {}, _pre_tokenizers(spec.get("pre_tokenizer"))
        shrink = _normalizer_shrink(spec.get("normalizer"))
        keeps_text = all(p.get("type") in _KEEPS_TEXT and p.get("behavior") != "Removed" for p in pres)
        if model.get("type") != "BPE" or shrink is None or not keeps_text:
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        unk = model.get("unk_token") is not None
        if unk and model.get("fuse_unk"):
            return None
        if model.get("byte_fallback"):
            missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
        elif any(p.get("type") == "ByteLevel" for p in pres):
            missing = [b for b, c in _BYTE_LEVEL.items() if c not in vocab]
        elif unk:
            missing = []
        else:
            return None  # a character outside the vocabulary is dropped, and any may be
        try:
            dropped = _chars_holding(missing)
        except ValueError:  # a missing continuation byte: too many characters hold one to list
            return None
        per_token = max((len(t.encode("utf-8")) for t in vocab), default=1) * shrink
        return per_token, dropped

    def at_least_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs a pass over the text: 0 where none is known. (A
        prompt of megabytes takes seconds to encode, all that time holding the GIL.)"""
        bound = self._length_bound
        if bound is None:
            return 0
        per_token, dropped = bound
        kept = len(text) if dropped is None else len(dropped.sub("", text))
        return kept // per_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`. The GIL is released while the text is encoded (`Tokenizer.encode` holds
        it; the batch call lets other threads run), so a long text encoded in a worker thread leaves the
        event loop and the engine's thread running. The ids are the same; the batch call, which computes
        no offsets, is also faster (0.32 s against 0.59 s for a megabyte of English with SmolLM2's)."""
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               keep_special: Collection[int] = ()) -> str:
        """The text of `ids`; with skip_special_tokens, special tokens are left out, except those of
        `keep_special` (the markers of a tool-call syntax, whose calls are read out of the text)."""
        ids = list(ids)
        if skip_special_tokens and keep_special:
            drop = self.all_special_ids
            ids = [i for i in ids if i in keep_special or i not in drop]
            skip_special_tokens = False
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json lacks 'chat_template'); "
                "use the completions API with a plain prompt, or add a template to tokenizer_config.json"
            )
        return _compile_template(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **context)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Text is emitted only once it is final: a multi-byte character split across tokens (emoji, CJK
    in byte-level vocabularies) decodes to U+FFFD until its last byte arrives, so nothing is emitted
    while the decoded tail ends in U+FFFD. Each step decodes a short window that starts a few tokens
    back (`prefix_offset`) so decoders that depend on the previous token (sentencepiece's leading
    space) see the same context as a full decode. Invariant: "".join(deltas) + flush() equals
    decode(generated ids, skip_special_tokens, keep_special).
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 keep_special: Collection[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep_special = frozenset(keep_special)
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - self._CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.keep_special)

    def fork(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        """A detokenizer like this one, for another output of `prompt_ids`, before it has any."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, self.skip_special_tokens, self.keep_special)

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Append token id(s); return the newly completed text ("" while a character is incomplete)."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (an incomplete character shows as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]
