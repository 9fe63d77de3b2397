"""RankInfo's cached hash: stable, consistent with equality, never carried across processes."""

from __future__ import annotations

import multiprocessing as mp
import pickle

from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool
from pdserve.kv_transfer.rank_info import RankInfo


def _info(rank_name: str = "ctx") -> RankInfo:
    table = page_table_for_block_major_pool(1 << 20, 8, 2, 1, 16, 64, 2, MapperKind.HND, range(2))
    return RankInfo(rank_name, 0, 1, 0, 1, 0, 1, 0, 1, 0, (2,), 1, 1, 64, 2, 16, table, b"desc", "tcp://127.0.0.1:1")


def _hash_in_child(data: bytes, out) -> None:
    info = pickle.loads(data)
    out.put((hash(info), hash(_info())))


def test_equal_infos_hash_equal_and_the_cache_is_not_pickled():
    a, b = _info(), _info()
    assert a == b and hash(a) == hash(b) and hash(a) == hash(a)
    assert _info("gen") != a
    restored = pickle.loads(pickle.dumps(a))
    assert "_hash" not in restored.__dict__ and restored == a and hash(restored) == hash(a)
    assert RankInfo.from_bytes(a.to_bytes()) == a


def test_a_pickled_info_hashes_like_a_fresh_one_in_another_process():
    a = _info()
    hash(a)  # populate the cache before pickling
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    child = spawn.Process(target=_hash_in_child, args=(pickle.dumps(a), out))
    child.start()
    try:
        pickled_hash, fresh_hash = out.get(timeout=60)
    finally:
        child.join(10)
    assert pickled_hash == fresh_hash
