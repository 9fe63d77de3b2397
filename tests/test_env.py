"""pdserve reads its environment in one module (pdserve/env.py), each variable with one meaning: the parse,
and an AST walk that fails on a read of os.environ anywhere else in the package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import env
from pdserve.env import Settings

ROOT = Path(__file__).parents[1]
CONFIG_LAYER = {ROOT / "pdserve" / "env.py"}
_ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}
_WRITES = {"setdefault", "update"}  # called for their effect on the environment, their result unused


def environment_reads(source: str) -> list[int]:
    """The lines of `source` that read the process environment: os.getenv, os.environ read or handed on
    (a subscript, .get, `**os.environ`, passed as a value), `from os import environ`. Writes are not
    reads: `os.environ[k] = v`, `del os.environ[k]`, and a statement that is `os.environ.setdefault(...)`
    or `os.environ.update(...)` alone."""
    tree = ast.parse(source)
    os_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                if a.name == "os"}
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            allowed.add(id(node.value))
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in _WRITES):
            allowed.add(id(node.value.func.value))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & _ENV_NAMES:
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES and isinstance(node.value, ast.Name)
              and node.value.id in os_names and id(node) not in allowed):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("source, reads", [
    ("import os\nx = os.environ.get('A')", [2]),
    ("import os\nx = os.environ['A']", [2]),
    ("import os\nx = os.getenv('A')", [2]),
    ("import os as o\nenv = {**o.environ, 'A': '1'}", [2]),
    ("import os\nf(os.environ)", [2]),
    ("import os\nx = os.environ.setdefault('A', '1')", [2]),
    ("from os import environ", [1]),
    ("import os\nos.environ['A'] = '1'\ndel os.environ['A']\nos.environ.setdefault('B', '1')", []),
    ("environ = {}\nx = environ.get('A')", []),
])
def test_the_walk_tells_reads_from_writes(source, reads):
    assert environment_reads(source) == reads


def test_no_module_outside_the_config_layer_reads_the_environment():
    files = sorted((ROOT / "pdserve").rglob("*.py"))
    assert len(files) > 100  # the walk found the package
    reads = [f"{f.relative_to(ROOT)}:{line}" for f in files if f not in CONFIG_LAYER
             for line in environment_reads(f.read_text())]
    assert not reads, "environment reads outside pdserve/env.py (add a field to env.Settings):\n" + "\n".join(reads)


def test_the_defaults():
    s = Settings.read({})
    base = Path.home() / ".cache" / "pdserve"
    assert (s.cache_dir, s.converted_dir, s.profiles_dir, s.kernel_cache) == (
        base, base / "converted", base / "profiles", base / "kernels")
    assert s.cpu_kernels and s.shm_all_reduce and s.kernel_march == "native" and s.kernel_path == "auto"
    assert s.host_id is None and s.disagg_config is None and s.compiler == "cc"


def test_the_cache_dir_is_the_base_of_every_cache(tmp_path):
    s = Settings.read({env.CACHE_DIR: str(tmp_path)})
    assert (s.converted_dir, s.profiles_dir, s.kernel_cache) == (
        tmp_path / "converted", tmp_path / "profiles", tmp_path / "kernels")
    own = Settings.read({env.CACHE_DIR: str(tmp_path), env.KERNEL_CACHE: str(tmp_path / "k")})
    assert own.kernel_cache == tmp_path / "k" and own.converted_dir == tmp_path / "converted"


def test_the_switches_and_values():
    s = Settings.read({env.CPU_KERNELS: "0", env.SHM_ALL_REDUCE: "0", env.KERNEL_MARCH: " x86-64-v3 ",
                       env.KERNEL_PATH: "gemv=torch", env.HOST_ID: "h1", env.COMPILER: "clang"})
    assert (s.cpu_kernels, s.shm_all_reduce, s.kernel_march, s.kernel_path, s.host_id, s.compiler) == (
        False, False, "x86-64-v3", "gemv=torch", "h1", "clang")
    assert Settings.read({env.CPU_KERNELS: "1", env.SHM_ALL_REDUCE: ""}).cpu_kernels


@pytest.mark.parametrize("name", [env.CPU_KERNELS, env.SHM_ALL_REDUCE])
def test_a_switch_out_of_range_is_an_error_naming_it(name):
    with pytest.raises(ValueError, match=f"{name}='off': expected 1 .* or 0"):
        Settings.read({name: "off"})


def test_settings_read_the_environment_as_it_is_now(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    assert env.settings().profiles_dir == tmp_path / "profiles"
    monkeypatch.delenv(env.CACHE_DIR)
    assert env.settings().cache_dir == Path.home() / ".cache" / "pdserve"


def test_a_child_gets_this_environment_and_what_it_is_handed(monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_MARK", "inherited")
    code = ("from pdserve.env import settings; import os; "
            "print(settings().disagg_config, os.environ['PDSERVE_TEST_MARK'])")
    out = subprocess.run([sys.executable, "-c", code], env=env.for_child({env.DISAGG_CONFIG: "{}"}),
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["{}", "inherited"]


def test_a_refused_value_stops_every_kernel_load_not_only_the_first():
    """PDSERVE_CPU_KERNELS=off is an error naming the variable at each load of either library (a load that
    refused once must not answer "no library" the next time, as if the kernels were turned off)."""
    code = """
from pdserve.kernels import cpu, recurrent
for load in (cpu.load, cpu.load, recurrent.load, recurrent.load):
    try:
        load()
    except ValueError as e:
        print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env.for_child({env.CPU_KERNELS: "off"}),
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.splitlines() == ["PDSERVE_CPU_KERNELS='off': expected 1 (on, the default) or 0 (off)"] * 4, out
