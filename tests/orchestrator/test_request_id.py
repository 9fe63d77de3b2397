"""Global request ids: range, field layout, rotation, uniqueness within and across generators/processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.orchestrator.request_id import (
    GLOBAL_ID_LIMIT,
    GLOBAL_ID_MIN,
    RequestIdGenerator,
    default_node_id,
    is_global_id,
    rotate,
    unrotate,
)


def test_ids_are_in_the_global_range_and_carry_their_fields():
    gen = RequestIdGenerator(node_id=200, process_id=63)
    ids = [gen.next_id() for _ in range(3000)]  # more than 1024: the counter must roll into the next ms
    assert all(GLOBAL_ID_MIN <= i < GLOBAL_ID_LIMIT and is_global_id(i) for i in ids)
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    fields = [unrotate(i) for i in ids]
    assert {f["node_id"] for f in fields} == {200} and {f["process_id"] for f in fields} == {63}
    assert max(f["counter"] for f in fields) <= 1023
    assert len({f["timestamp_ms"] for f in fields}) >= 3


def test_rotation_keeps_every_raw_value_out_of_the_local_range():
    assert rotate(0) == GLOBAL_ID_MIN
    assert rotate(GLOBAL_ID_LIMIT - GLOBAL_ID_MIN - 1) == GLOBAL_ID_LIMIT - 1
    assert rotate(GLOBAL_ID_LIMIT - GLOBAL_ID_MIN) == GLOBAL_ID_MIN  # wraps, never below 2^40
    assert rotate(GLOBAL_ID_LIMIT - 1) >= GLOBAL_ID_MIN
    assert not is_global_id(GLOBAL_ID_MIN - 1) and not is_global_id(GLOBAL_ID_LIMIT)
    with pytest.raises(ValueError, match="not a global request id"):
        unrotate(17)


def test_generators_with_different_node_or_process_ids_never_collide():
    gens = [RequestIdGenerator(node_id=n, process_id=p) for n in (0, 1) for p in (0, 1)]
    ids = [g.next_id() for _ in range(500) for g in gens]  # interleaved: same milliseconds
    assert len(set(ids)) == len(ids)


_MINT = ("import json, sys; from pdserve.orchestrator.request_id import RequestIdGenerator; "
         "g = RequestIdGenerator(node_id=7, process_id=int(sys.argv[1])); "
         "print(json.dumps([g.next_id() for _ in range(2000)]))")


def test_processes_of_one_fleet_mint_disjoint_ids():
    procs = [subprocess.Popen([sys.executable, "-c", _MINT, str(p)], stdout=subprocess.PIPE, text=True)
             for p in (0, 1)]
    outs = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
    assert not set(outs[0]) & set(outs[1])
    assert all(unrotate(i)["process_id"] == p for p, ids in enumerate(outs) for i in ids)


def test_bad_node_or_process_id_is_refused_by_name():
    with pytest.raises(ValueError, match="node_id must be in"):
        RequestIdGenerator(node_id=256)
    with pytest.raises(ValueError, match="at most 64 fleet workers"):
        RequestIdGenerator(node_id=0, process_id=64)


def test_default_node_id_is_a_stable_byte():
    assert default_node_id() == default_node_id()
    assert 0 <= default_node_id() < 256
    assert 0 <= unrotate(RequestIdGenerator().next_id())["node_id"] < 256
