"""Every worker config key is documented in docs/configuration.md, and a config with a pipelined
transceiver parses (it used to be refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import BounceSettings, CacheTransceiverConfig, EngineConfig, WorkerConfig

DOC = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("cls, prefix", [(EngineConfig, ""), (WorkerConfig, ""), (CacheTransceiverConfig, ""),
                                         (BounceSettings, "bounce.")])
def test_every_key_is_documented(cls, prefix):
    missing = [k for k in cls.model_fields if f"`{prefix}{k}`" not in DOC]
    assert not missing, f"docs/configuration.md does not document {cls.__name__} keys {missing}"


def test_pipelined_transfer_parses_and_unknown_keys_are_refused():
    cfg = WorkerConfig(cache_transceiver_config={"backend": "shm", "pipelined_transfer": True})
    assert cfg.cache_transceiver_config.pipelined_transfer
    with pytest.raises(ValueError, match="pipelined"):
        WorkerConfig(cache_transceiver_config={"backend": "shm", "pipelined": True})
