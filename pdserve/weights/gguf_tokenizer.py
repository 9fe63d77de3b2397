"""Rebuild tokenizer.json / tokenizer_config.json / generation_config.json from GGUF metadata.

A GGUF carries its tokenizer as fields, not as a tokenizer.json:

    tokenizer.ggml.model       "gpt2" (byte-level BPE) or "llama" (sentencepiece BPE, byte fallback)
    tokenizer.ggml.pre         which pre-tokenizer split the merges were learned with ("smollm", ...)
    tokenizer.ggml.tokens      id -> token string          tokenizer.ggml.token_type  id -> TokenType
    tokenizer.ggml.merges      "a b" pairs, best first     tokenizer.ggml.scores      sentencepiece scores
    tokenizer.ggml.{bos,eos,eot,eom,unknown,padding}_token_id, add_bos_token, add_space_prefix
    tokenizer.chat_template

Tokens typed CONTROL become special added tokens, USER_DEFINED plain added tokens, so both stay
whole in text. An unknown `pre` is refused: a wrong split silently changes token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The split for a byte-level vocabulary, named by llama.cpp's `tokenizer.ggml.pre`."""
    if pre in (None, "default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        # GPT-2's regex after splitting every digit on its own.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    splits = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
    if pre not in splits:
        raise NotImplementedError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: default, gpt2, smollm, starcoder, "
            f"{', '.join(sorted(splits))}); convert the original Hugging Face checkpoint instead"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate spelling keeps its first id, as llama.cpp's lookup does
    return vocab


def _merges(meta: Mapping[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        pairs = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
        bad = [m for m in pairs if len(m) != 2]
        if bad:
            raise ValueError(f"GGUF merges must be 'left right' pairs; found {[' '.join(b) for b in bad[:3]]}")
        return pairs  # type: ignore[return-value]
    return sentencepiece_merges(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores"), vocab)


def sentencepiece_merges(tokens: list[str], scores: list[float] | None, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a scored sentencepiece vocabulary (files that store no merges).

    Every split of a token into two vocabulary pieces is a merge producing it. A better-scored result
    merges first; among equals, longer left then longer right pieces first, then vocabulary order.
    """
    if scores is None:
        raise ValueError("GGUF sentencepiece tokenizer has neither merges nor scores; the file is incomplete")
    found = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: ties keep vocabulary order
    return [(m[3], m[4]) for m in found]


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TokenType.CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED]
    return special, user


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` Tokenizer that GGUF metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("GGUF has no tokenizer.ggml.tokens; it carries no tokenizer to rebuild")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
    vocab = _vocab(tokens)
    if kind == "gpt2":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True, byte_fallback=True,
                                   unk_token=tokens[unk_id] if unk_id is not None else None))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Prepend("\u2581")] if prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' sentencepiece BPE); convert the original Hugging Face checkpoint instead"
        )
    special, user = _added_tokens(tokens, types)
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        head = [(tokens[bos_id], bos_id)] if add_bos else []
        tail = [(tokens[eos_id], eos_id)] if add_eos else []
        single = " ".join([f"{t}:0" for t, _ in head] + ["$A:0"] + [f"{t}:0" for t, _ in tail])
        pair = single + " " + " ".join([f"{t}:1" for t, _ in head] + ["$B:1"] + [f"{t}:1" for t, _ in tail])
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=head + tail)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer_files(meta: Mapping[str, Any], context_length: int) -> tuple[Tokenizer, dict, dict]:
    """(tokenizer, tokenizer_config.json dict, generation_config.json dict) for GGUF metadata."""
    tok = build_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    kind = meta.get("tokenizer.ggml.model")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    # End-of-generation ids: eos plus the chat turn terminators llama.cpp records separately.
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and i not in eos_ids:
            eos_ids.append(int(i))
    generation_config: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        generation_config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if eos_ids:
        generation_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation_config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return tok, tokenizer_config, generation_config
