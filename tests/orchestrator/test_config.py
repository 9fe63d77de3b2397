"""DisaggConfig: the documented example parses; each mistake is a ValueError naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve.orchestrator.config import DisaggConfig, load_disagg_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "orchestrator.md"
BASE = {"context_servers": {"urls": ["http://127.0.0.1:8001"]},
        "generation_servers": {"urls": ["127.0.0.1:8002"]}}


def write(tmp_path, data) -> Path:
    p = tmp_path / "disagg.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_and_url_normalisation(tmp_path):
    cfg = load_disagg_config(write(tmp_path, BASE))
    assert cfg.port == 8000 and cfg.hostname == "127.0.0.1" and cfg.num_workers == 1
    assert cfg.schedule_style == "context_first" and cfg.conditional_disagg is None
    assert cfg.generation_servers.urls == ["http://127.0.0.1:8002"]
    assert cfg.context_servers.router.type == "round_robin"
    assert cfg.coordinator_url == "http://127.0.0.1:7999" and not cfg.uses_coordinator


def test_cli_overrides_win(tmp_path):
    cfg = load_disagg_config(write(tmp_path, {**BASE, "port": 9000}), port=9100, num_workers=3, api_key=None)
    assert cfg.port == 9100 and cfg.num_workers == 3 and cfg.uses_coordinator


def test_documented_example_parses():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, f"{DOC} has no yaml example"
    for block in blocks:
        cfg = DisaggConfig(**yaml.safe_load(block))
        assert cfg.context_servers.urls and cfg.generation_servers.urls


@pytest.mark.parametrize("change, message", [
    ({"context_servers": {"urls": ["h:1"], "minimal_instances": -1}}, "context_servers.minimal_instances"),
    ({"lease_ttl_s": 0}, "lease_ttl_s"),
    ({"context_servers": {"urls": ["http://h"]}}, "must look like http://host:port"),
    ({"context_servers": {"urls": ["http://h:1/v1"]}}, "must not have a path"),
    ({"context_servers": {"urls": ["h:1", "http://h:1"]}}, "listed twice"),
    ({"port": 8100, "generation_servers": {"urls": ["http://localhost:8100"]}}, "this orchestrator's own address"),
    ({"generation_servers": {"urls": ["h:2"], "router": {"type": "random"}}}, "generation_servers.router.type"),
    ({"generation_servers": {"urls": ["h:2"], "router": {"type": "load_balancing", "options": {"metric": "kv"}}}},
     "'requests' or 'tokens'"),
    ({"generation_servers": {"urls": ["h:2"], "router": {"type": "round_robin", "options": {"metric": "x"}}}},
     "has no option 'metric'"),
    ({"generation_servers": {"urls": ["h:2"], "router": {"type": "conversation", "options": {"max_sessions": 0}}}},
     "positive integer"),
    ({"schedule_style": "gen_first"}, "schedule_style"),
    ({"num_workers": 65}, "num_workers"),
    ({"conditional_disagg": {"max_local_prefill_length": -1}}, "max_local_prefill_length"),
    ({"disagg_coordinator_url": "coordinator"}, "disagg_coordinator_url"),
    ({"node_id": 300}, "node_id"),
    ({"request_timeout": 0}, "request_timeout"),
    ({"contxt_servers": {}}, "contxt_servers"),
])
def test_invalid_config_names_the_key(tmp_path, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_disagg_config(write(tmp_path, {**BASE, **change}))


def test_a_role_without_urls_waits_for_joins_and_a_missing_file_is_refused(tmp_path):
    cfg = load_disagg_config(write(tmp_path, {"context_servers": BASE["context_servers"]}))
    assert cfg.generation_servers.urls == [] and cfg.generation_servers.minimal_instances == 1
    with pytest.raises(ValueError, match="does not exist"):
        load_disagg_config(tmp_path / "nope.yaml")
