"""Test helpers that ship with pdserve: tiny random-weight models saved as real HF directories."""

from pdserve.testing.tiny import build_tiny_tokenizer, make_tiny_model

__all__ = ["build_tiny_tokenizer", "make_tiny_model"]
