"""The tiny models' tokenizer: a deterministic byte-level BPE trained on a fixed text, and the files it is saved
as beside a tiny checkpoint (tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json).
Its own module so that the writers of tiny checkpoints (tiny.py, tiny_published.py) share it without importing
each other."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.weights.hf_dir import GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, write_json

# ids 0, 1, 2 in every tiny vocabulary (the trainer puts special tokens first).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2
_BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + _BYTE_ALPHABET

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text for the tiny BPE: English, code, digits and non-ASCII, so merges exist for
# all of them and encoded prompts are a mix of multi-byte and single-byte tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. The capital of France is Paris.
A language model predicts the next token from the tokens before it. The prefill phase reads the
whole prompt at once; the decode phase produces one token per step and reads the KV cache.
Disaggregated serving runs the prefill on one instance and the decode on another, and moves the
key and value cache between them exactly once per request.
def forward(self, hidden_states, positions):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    return self.self_attn(hidden_states, positions) + residual
for i in range(10): print(i * 2, i ** 2, "value", [i, i + 1])
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1e-5 65536 -7
Unicode: café naïve résumé Zürich Ελληνικά русский 日本語 中文 한국어 emoji 🙂 🚀 ✓
Tensor parallelism splits every weight across ranks; pipeline parallelism gives each rank a range
of layers. Both are chosen by configuration and both must give the same tokens as one rank.
"""


# Qwen2's pre-tokenizer split. transformers builds Qwen2 tokenizers with this split whatever
# tokenizer.json says, so a qwen2 tiny model uses it too and every reader agrees on the ids.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(arch: str) -> pre_tokenizers.PreTokenizer:
    if arch == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int, arch: str) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer(arch)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    # The corpus may run out of merges before vocab_size; fill the rest with reserved specials so
    # the tokenizer and the embedding always agree on the vocabulary size.
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - n)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer.to_str()


def build_tiny_tokenizer(vocab_size: int = 512, arch: str = "llama") -> Tokenizer:
    """A deterministic byte-level BPE tokenizer with exactly `vocab_size` ids (split as `arch` does)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs "
            f"{_BYTE_ALPHABET} byte tokens + {len(SPECIAL_TOKENS)} special tokens = {MIN_VOCAB_SIZE}"
        )
    return Tokenizer.from_str(_tokenizer_json(vocab_size, arch))


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_position_embeddings: int) -> None:
    """The tiny tokenizer with the ChatML template, and a generation config that names its special tokens."""
    tokenizer.save(str(out / TOKENIZER_FILE))
    write_json(
        out / TOKENIZER_CONFIG_FILE,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": UNK_TOKEN,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": max_position_embeddings,
            "chat_template": CHATML_TEMPLATE,
        },
    )
    write_json(
        out / GENERATION_CONFIG_FILE,
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID},
    )
