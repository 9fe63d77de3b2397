"""pdserve: LLM serving with prefill/decode disaggregation."""

import os

# Large CPU tensors (weights, the KV pool, big activations) on 2 MiB transparent huge pages. A decode
# step reads every weight and every KV row once, and with 4 KiB pages those reads miss the TLB.
# PyTorch reads this variable once, at its
# first allocation, so it is set here, before pdserve imports torch; a value already in the
# environment wins, and `THP_MEM_ALLOC_ENABLE=0` turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
