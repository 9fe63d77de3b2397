"""pdserve: LLM serving with prefill/decode disaggregation."""

__version__ = "0.1.0"
