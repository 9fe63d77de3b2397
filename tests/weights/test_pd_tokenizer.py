"""pdserve.tokenizer: ids and chat prompts equal transformers'; streaming emits only complete text."""

import threading
import time

import jinja2
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from pdserve.testing import make_tiny_model
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TEXTS = [
    "Hello world", "The capital of France is", "", " ", "\n", "\n\n  \t\n", "a" * 40,
    "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n", "12345 678.9 +1e-5 0x1F 2024-11-30",
    "I'm sure they'll say we're done", "日本語のテキスト、中文，한국어", "café naïve Zürich Ελληνικά русский",
    "emoji 🙂🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "def f(x):\n    return {'k': [x**2, None]}  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>text<|endoftext|>",
    "http://example.com/path?q=1&b=2#frag", "$$\\int_0^1 x^2\\,dx$$", "\u200bzero\u200dwidth\ufeff",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tok") / request.param, arch=request.param)


def _assert_same_as_transformers(ours: Tokenizer, ref, texts=TEXTS, conversations=CONVERSATIONS):
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                ref(text, add_special_tokens=special).input_ids, (text, special)
        ids = ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
                ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_tiny_tokenizer_equals_transformers(tiny_dir):
    ours = Tokenizer.from_dir(tiny_dir)
    _assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(tiny_dir))
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and ours.vocab_size == 512
    assert {0, 1, 2} <= ours.all_special_ids


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers(smollm2_dir, smollm2_reference):
    _, ref_gguf = smollm2_reference
    ours = Tokenizer.from_dir(smollm2_dir)
    _assert_same_as_transformers(ours, transformers.AutoTokenizer.from_pretrained(smollm2_dir))
    _assert_same_as_transformers(ours, ref_gguf)
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and ours.vocab_size == 49152
    prompt = ours.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def _stream(tok, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.step(i) for i in ids]
    return deltas, detok.flush()


def test_streaming_holds_back_split_characters(tmp_path):
    tok = Tokenizer.from_dir(make_tiny_model(tmp_path / "m"))
    text = "ok 🚀 then 日本 and 👨‍👩‍👧!"
    ids = tok.encode(text)
    deltas, rest = _stream(tok, ids, prompt_ids=tok.encode("Say: "))
    assert "".join(deltas) == text and rest == ""
    assert all("\ufffd" not in d for d in deltas)
    # The tiny vocabulary has no single token for 🚀, so its bytes span tokens and some steps emit "".
    assert len(ids) > len(text.encode("utf-8")) // 4 and "" in deltas


def test_streaming_flush_returns_an_incomplete_tail(tmp_path):
    tok = Tokenizer.from_dir(make_tiny_model(tmp_path / "m"))
    ids = tok.encode("a🚀")
    cut = ids[:-1]  # drop the last byte-token of the emoji
    deltas, rest = _stream(tok, cut)
    assert "".join(deltas) == "a" and rest == tok.decode(cut)[1:] and rest.endswith("\ufffd")


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("stream") / "m"))


def test_encoding_lets_other_threads_run(tiny_tok):
    """A long prompt is encoded in a worker thread so that the event loop and the engine's step thread go
    on meanwhile; that only helps if encoding lets go of the GIL (tokenizers' single-text encode holds it:
    a 1 MiB prompt paused another client's stream 0.42-0.62 s, benchmarks/hostile_bodies.py)."""
    text = "the quick brown fox " * (1 << 16)  # 1.25 MiB: about half a second to encode here
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        while ticks[0] == 0:
            time.sleep(0.001)
        before, start = ticks[0], time.monotonic()
        ids = tiny_tok.encode(text)
        during, took = ticks[0] - before, time.monotonic() - start
    finally:
        stop.set()
        ticker.join()
    assert ids == tiny_tok.backend.encode(text).ids  # the same ids as the single-text call
    assert during >= 10, f"a ticking thread ran {during} times in the {took:.2f} s the text took to encode"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
@example(text="a<|im_end|>b")
def test_streamed_text_equals_the_text(tiny_tok, text):
    ids = tiny_tok.encode(text, add_special_tokens=False)
    # A text that spells a special token ('<|im_end|>', which Hypothesis finds among our sources' strings)
    # encodes to it, and output skips special tokens; any ids, specials too: the test below.
    assume(not set(ids) & tiny_tok.all_special_ids)
    deltas, rest = _stream(tiny_tok, ids)
    assert "".join(deltas) + rest == text


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=30))
def test_streamed_text_equals_decode_of_any_ids(tiny_tok, ids):
    deltas, rest = _stream(tiny_tok, ids, prompt_ids=[5, 6, 7])
    assert "".join(deltas) + rest == tiny_tok.decode(ids)


def test_template_helpers_behave_like_transformers(tiny_tok):
    tok = Tokenizer(tiny_tok.backend, tiny_tok.config, chat_template=(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}|{% endfor %}{{ eos_token }}"))
    msgs = [{"role": "user", "content": "café"}] * 3
    assert tok.apply_chat_template(msgs) == '{"role": "user", "content": "café"}|' * 2 + "<|im_end|>"
    with pytest.raises(jinja2.exceptions.TemplateError, match="role bad is not allowed"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    sandboxed = Tokenizer(tiny_tok.backend, {}, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny_tok.backend, {}).apply_chat_template([])


def test_missing_tokenizer_file_is_explained(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
