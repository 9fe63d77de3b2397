"""The user's cache_transceiver_config becomes the library's TransceiverConfig in one place
(`CacheTransceiverConfig.to_transceiver_config`), and the two agree on every default."""

from __future__ import annotations

from pdserve.config import BounceSettings, CacheTransceiverConfig
from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.transceiver import TransceiverConfig


def test_defaults_translate_to_the_library_defaults():
    assert CacheTransceiverConfig().to_transceiver_config() == TransceiverConfig()
    assert BounceSettings().to_bounce_config() is None
    assert BounceSettings(enabled=True).to_bounce_config() == BounceConfig()


def test_the_user_facing_defaults():
    cfg = CacheTransceiverConfig()
    assert (cfg.kv_transfer_timeout_ms, cfg.rank_info_timeout_s, cfg.max_control_message_mb) == (30_000, 5.0, 16)
    b = cfg.bounce
    assert (b.staging_mb, b.min_kv_blocks, b.min_fragments, b.max_mean_fragment_kb) == (256, 96, 1024, 16)


def test_every_key_translates_in_its_unit():
    cfg = CacheTransceiverConfig(
        backend="shm", kv_transfer_timeout_ms=1234, rank_info_timeout_s=0.25, max_control_message_mb=3,
        cluster_token="secret", checksum=True,
        bounce={"enabled": True, "staging_mb": 5, "min_kv_blocks": 7, "min_fragments": 9, "max_mean_fragment_kb": 2})
    assert cfg.to_transceiver_config() == TransceiverConfig(
        kv_transfer_timeout_ms=1234, rank_info_timeout_s=0.25, max_control_message_bytes=3 << 20,
        cluster_token="secret", checksum=True,
        bounce=BounceConfig(staging_bytes=5 << 20, min_kv_blocks=7, min_fragments=9, max_avg_fragment_bytes=2 << 10))
