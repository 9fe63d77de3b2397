"""`pdserve serve`'s flags: one per scalar config key, validated with the YAML file they override."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, serve_config
from pdserve.config import WorkerConfig


def _config(*argv: str) -> WorkerConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_flags_reach_the_config_typed():
    cfg = _config("some/model", "--dtype", "bfloat16", "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5",
                  "--no-enable-prefix-caching", "--tp", "2", "--pp", "3", "--device", "cpu", "--port", "9001",
                  "--max-model-len", "4096")
    assert (cfg.model, cfg.dtype, cfg.max_num_seqs, cfg.kv_cache_memory_gb) == ("some/model", "bfloat16", 8, 0.5)
    assert (cfg.enable_prefix_caching, cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == (False, 2, 3)
    assert (cfg.device, cfg.port, cfg.max_model_len) == ("cpu", 9001, 4096)


def test_no_flags_leave_the_defaults():
    assert _config() == WorkerConfig()


def test_every_scalar_key_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    shown = capsys.readouterr().out
    nested = {"cache_transceiver_config"}  # YAML only
    assert [k for k in WorkerConfig.model_fields if k not in nested | {"model"}
            if f"--{k.replace('_', '-')}" not in shown] == []


def test_join_flags_reach_the_config_and_go_together():
    cfg = _config("--join", "10.0.0.5:8000", "--role", "generation", "--advertise-url", "http://10.0.0.9:8101")
    assert (cfg.join, cfg.role, cfg.advertise_url) == ("http://10.0.0.5:8000", "generation", "http://10.0.0.9:8101")
    with pytest.raises(ValueError, match="join and role go together"):
        _config("--join", "http://10.0.0.5:8000")
    with pytest.raises(ValueError, match="advertise_url"):
        _config("--join", "http://10.0.0.5:8000", "--role", "context", "--host", "0.0.0.0")
    with pytest.raises(ValueError, match=r"join: .*must look like http://host:port"):
        _config("--join", "http://10.0.0.5", "--role", "context")


def test_a_flag_overrides_the_file(tmp_path):
    path = tmp_path / "worker.yaml"
    path.write_text("max_num_seqs: 4\ndtype: bfloat16\ncache_transceiver_config:\n  backend: shm\n")
    cfg = _config("--config", str(path), "--max-num-seqs", "12")
    assert (cfg.max_num_seqs, cfg.dtype, cfg.cache_transceiver_config.backend) == (12, "bfloat16", "shm")


@pytest.mark.parametrize("argv, key", [(["--max-num-seqs", "0"], "max_num_seqs"),
                                       (["--max-num-tokens", "lots"], "max_num_tokens"),
                                       (["--kv-cache-memory-gb", "-1"], "kv_cache_memory_gb")])
def test_a_bad_value_names_its_key(argv, key):
    with pytest.raises(ValueError, match=rf"invalid WorkerConfig:\n  {key}: "):
        _config(*argv)


def test_a_value_outside_the_choices_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--dtype", "float8"])
    assert e.value.code == 2
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_the_global_log_level_flag_before_disaggregated(capsys):
    """`pdserve --log-level WARNING disaggregated -c f.yaml` used to be refused ('unrecognized arguments')."""
    from pdserve.cli import main

    for argv in (["--log-level", "WARNING", "disaggregated", "--help"],
                 ["--log-level=INFO", "disaggregated", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        assert "usage: pdserve disaggregated" in capsys.readouterr().out


@pytest.mark.parametrize("text, says", [("max_num_seqs: [4\n", "is not valid YAML"),
                                        ("- 4\n", "must hold a mapping of keys to values, not list")])
def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path, text, says):
    """Before, bad YAML ended `pdserve serve --config` in a traceback."""
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"config file {path} {says}"):
        _config("--config", str(path))
