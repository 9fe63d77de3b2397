"""The planner's profile on a GPU: forward steps timed on CUDA (one unit = one GPU), then a plan from it.
Skipped without a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.cli import main
from pdserve.plan.profile import load_or_measure
from pdserve.testing.tiny import make_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_gpu_profile_and_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_tiny_model(tmp_path / "tiny", num_layers=2, num_heads=4, num_kv_heads=2))
    profile, path, fresh = load_or_measure(model, device="cuda", progress=False)
    assert fresh and profile.key["device"] == "cuda" and profile.units == [1]
    t = profile.steps[1]
    assert all(s > 0 for s in t.prefill.values()) and all(s > 0 for s in t.decode.values())
    from pdserve.plan.profile import describe, nixl_installed

    # The KV writes are timed between two VRAM pools (nixl), as the instances' pools are; shm moves host memory only.
    assert sorted(profile.transfer) == (["nixl"] if nixl_installed() else [])
    assert ("VRAM to VRAM" if nixl_installed() else "not measured") in describe(profile)
    print(describe(profile))
    print(f"\nGPU profile {profile.key['machine']}: " + ", ".join(
        f"prefill {n} {1000 * s:.2f} ms" for n, s in sorted(t.prefill.items())))
    out = tmp_path / "cluster.yaml"
    assert main(["plan", "--model", model, "--device", "cuda", "--slo", "ttft:500,tpot:50", "--input-len", "512",
                 "--output-len", "32", "--out", str(out)]) == 0
    assert out.exists() and os.path.getsize(out) > 0
