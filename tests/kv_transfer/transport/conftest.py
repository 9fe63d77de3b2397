"""Make this directory's helper modules importable by name, also in spawned child processes
(multiprocessing's spawn start method ships the parent's sys.path to the child)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402  (after the sys.path set-up above)

from kvt_instance import Topology, build_instance, shutdown  # noqa: E402


@pytest.fixture
def pair():
    """make(ctx_topo, gen_topo, timeout_ms, ...) -> (ctx ranks, gen ranks): two instances in this process over
    the in-process fake agent, closed at teardown. ctx_options / gen_options: more build_instance keywords
    (checksum, faults, ...) for one side."""
    made = []

    def make(ctx_topo=Topology("ctx"), gen_topo=Topology("gen"), timeout_ms=20_000, ctx_options=None,
             gen_options=None):
        ctx = build_instance(ctx_topo, "fake", timeout_ms, **(ctx_options or {}))
        gen = build_instance(gen_topo, "fake", timeout_ms, **(gen_options or {}))
        made.extend(ctx + gen)
        return ctx, gen

    yield make
    shutdown(made)
