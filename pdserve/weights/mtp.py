"""Multi-token-prediction (MTP) weights that ride along in published checkpoints: pdserve does not speculate
with them (yet), so it recognises them, skips them and says so once, instead of refusing them as unknown
tensors or taking them for decoder layers.

    DeepSeek-V3 / R1 / V3.1 (and GLM-4.5): model.layers.{L}.* for num_hidden_layers <= L < num_hidden_layers +
        num_nextn_predict_layers: a whole decoder layer plus enorm, hnorm, eh_proj, embed_tokens, shared_head.*
    Qwen3.5 / Qwen3-Next: mtp.*  (mtp.fc, mtp.layers.N.*, mtp.norm, mtp.pre_fc_norm_embedding / _hidden)

Past the MTP layers a layer index is still an error: a checkpoint with more layers than its config.json names
is not the model the config describes.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MtpWeights:
    """Which of a checkpoint's tensors (named as pdserve's loader names them) are MTP weights."""

    def __init__(self, config: dict[str, Any], num_layers: int):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        self.first = num_layers  # DeepSeek's MTP layers follow the decoder's
        self.end = num_layers + int(text.get("num_nextn_predict_layers") or config.get("num_nextn_predict_layers") or 0)
        self.skipped = 0

    def claims(self, name: str) -> bool:
        """True (and counted) for an MTP tensor."""
        m = _LAYER.match(name)
        mtp = name.startswith("mtp.") or (m is not None and self.first <= int(m.group(1)) < self.end)
        self.skipped += mtp
        return mtp

    def report(self) -> None:
        """One log line for the MTP tensors skipped, if any."""
        if self.skipped:
            log.info("skipped %d multi-token-prediction tensors (the checkpoint's MTP layers): pdserve decodes one "
                     "token per step and does not use them", self.skipped)
