"""Tokenizer.at_least_tokens: a lower bound on a text's token count from its length alone, which lets the
server refuse a prompt of megabytes without encoding it (seconds, holding the GIL). It must never
exceed the real count (a prompt that fits would be refused), and where one token may stand for any
amount of text it is 0."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers

from pdserve.testing import make_tiny_model
from pdserve.tokenizer import Tokenizer

# characters a byte-level vocabulary may lack (SmolLM2's lacks bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and
# the lead bytes 0xF1, 0xF2), characters that compose under NFC, spaces, a long token's worth of '='
ODD = ["\x04", "\x06", "\x13", "\x1d", "\U00041234", "\U000b0000", "e\u0301", "\u1100\u1161\u11a8", "\uff21",
       " ", "  ", "\n", "=" * 16, "a", "ab", "é", "가", "🙂", "<|im_end|>"]
TEXTS = st.lists(st.sampled_from(ODD) | st.text(max_size=8), max_size=60).map("".join) | st.builds(
    lambda piece, n: piece * n, st.sampled_from(ODD), st.integers(1, 3000))


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request, tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("bound") / request.param, arch=request.param))


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
@example(text="\x04" * 5000)
@example(text="a" * 20000)
def test_the_bound_never_exceeds_the_count_tiny(tiny, text):
    assert tiny.at_least_tokens(text) <= len(tiny.encode(text))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
@example(text="\x04" * 5000 + "hi")
@example(text="=" * 20000)
def test_the_bound_never_exceeds_the_count_smollm2(smollm2, text):
    assert smollm2.at_least_tokens(text) <= len(smollm2.encode(text))


def test_the_bound_is_useful_where_it_matters(tiny):
    """A megabyte of text proves itself longer than any context this tiny model has."""
    assert tiny.at_least_tokens("a" * (1 << 20)) > 4096
    assert tiny.at_least_tokens("hi") == 0


VOCAB = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4, "\u2581": 5, "\u2581ab": 6}
MERGES = [("a", "b"), ("ab", "ab"), ("\u2581", "ab")]


def _built(model=None, normalizer=None, pre_tokenizer=None) -> Tokenizer:
    backend = tokenizers.Tokenizer(model or models.BPE(VOCAB, MERGES, unk_token="<unk>"))
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return Tokenizer(backend)


@pytest.mark.parametrize("case,tok", [
    ("BPE with an unknown token", lambda: _built()),
    ("sentencepiece-style normalizer and Metaspace", lambda: _built(
        normalizer=normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
        pre_tokenizer=pre_tokenizers.Metaspace())),
    ("NFC, which composes", lambda: _built(normalizer=normalizers.NFC())),
])
def test_bounded_tokenizers(case, tok):
    tok = tok()
    for text in ["ab" * 500, "abab " * 300, "e\u0301" * 400, "\u1100\u1161\u11a8" * 300, "zzz" * 300, "a"]:
        least = tok.at_least_tokens(text)
        assert least <= len(tok.encode(text)), (case, text[:12])
    assert tok.at_least_tokens("ab" * 5000) > 0, case


def test_composing_normalizers_are_allowed_for():
    """NFC makes one two-byte character of three (u, a diaeresis, a macron): 1200 characters are 100
    tokens of the longest (eight bytes); a bound that took a character for a byte would say 150."""
    u = "\u01d6"  # what NFC makes of "u\u0308\u0304"
    vocab = {"<unk>": 0, u: 1, u * 2: 2, u * 4: 3}
    tok = _built(models.BPE(vocab, [(u, u), (u * 2, u * 2)], unk_token="<unk>"), normalizer=normalizers.NFC())
    text = "u\u0308\u0304" * 400
    assert len(tok.encode(text)) == 100
    assert 0 < tok.at_least_tokens(text) <= 100


@pytest.mark.parametrize("case,tok", [
    ("WordPiece: an unknown word is one token", lambda: _built(models.WordPiece({"[UNK]": 0, "a": 1},
                                                                               unk_token="[UNK]"))),
    ("Unigram", lambda: _built(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))),
    ("BPE that fuses unknown runs", lambda: _built(models.BPE(VOCAB, MERGES, unk_token="<unk>", fuse_unk=True))),
    ("BPE that drops what it has no token for", lambda: _built(models.BPE(VOCAB, MERGES))),
    ("a pre-tokenizer that drops whitespace", lambda: _built(pre_tokenizer=pre_tokenizers.Whitespace())),
    ("a normalizer that deletes", lambda: _built(normalizer=normalizers.Strip())),
    ("a Replace that shortens", lambda: _built(normalizer=normalizers.Replace("abab", "a"))),
])
def test_unbounded_tokenizers_give_no_bound(case, tok):
    assert tok().at_least_tokens("ab" * 5000 + " " * 5000) == 0, case
