"""The transceiver's bounce glue (the segment format and gates are bounce.py's).

    receiver: request_and_receive_async ──> offer: lease one staging segment per writer, sent
              with REQUEST_DATA (the receiver's BounceConfig, the segment's pointer, its writers)
    sender:   the write of a one-chunk send ──> gather: when both configs are equal and the plan
              passes the gates, pack it into our staging and write that into our segment (one
              descriptor per receiver, however many fragments the plan has)
    receiver: its TRANSFER_DONE says "bounced" ──> scatter the segment into the KV pool
    receiver: the session ends ──> its lease is returned, or quarantined while a writer may still write

The receiver never computes an address: it offers room, and checks every destination the sender
wrote into the segment lies in its own KV regions before it copies (bounce.scatter). The staging
buffer lives where the KV does: GPU memory of the pool's device when the KV is there, so a
head-mismatch write on VRAM is gathered and scattered by the GPU, not staged through the host.
"""

from __future__ import annotations

import logging

import numpy as np

from pdserve.kv_transfer.agents.base import RegionTable
from pdserve.kv_transfer.bounce import StagingBuffer, StagingLease, gather, plan_segment_bytes, scatter, segment_bound
from pdserve.kv_transfer.control.messages import RequestData, TransferDone
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.sessions import RecvSession, SendSession
from pdserve.kv_transfer.transceiver.base import Local

logger = logging.getLogger(__name__)


class Bouncer:
    """One rank's staging buffer (None without a BounceConfig) and the three bounce steps over it."""

    def __init__(self, local: Local) -> None:
        self._local = local
        cfg = local.config.bounce
        # On the KV pool's device, so gathers and scatters never leave it (bounce.py); None: host memory.
        devices = {r.device_id for r in local.agent.registered_regions if r.is_device}
        if len(devices) > 1:
            raise KVTransferError(f"the KV memory of this rank spans GPUs {sorted(devices)}; one rank's KV must "
                                  "live on one device")
        self.device = f"cuda:{devices.pop()}" if devices else None
        # Registered before local_descriptor() is taken, so peers can write into it.
        self.staging = StagingBuffer(local.agent, cfg.staging_bytes, self.device) if cfg else None

    def close(self) -> None:
        if self.staging is not None:
            self._local.agent.deregister_memory(self.staging.region)
            self.staging = None

    def release(self, lease: StagingLease) -> None:
        self.staging.release(lease)

    # -- receiver -----------------------------------------------------------------------------
    def offer(self, session: RecvSession, ids: dict[int, np.ndarray]) -> dict | None:
        """Lease one staging segment per writer when the request is big enough to maybe bounce."""
        cfg, own = self._local.config.bounce, self._local.own
        num_blocks = sum(int((b >= 0).sum()) for b in ids.values())
        if cfg is None or (num_blocks < cfg.min_kv_blocks and self.device is None) or not session.writers:
            return None
        if self.device is not None and all(w.kv_heads_per_rank == own.kv_heads_per_rank
                                           and w.tokens_per_block == own.tokens_per_block
                                           for w in session.writer_infos.values()):
            return None  # intact pairs write a few large runs, which never bounce: hold no device memory for them
        table = own.page_table
        payload = sum(int((ids.get(g.group_id, np.zeros(0)) >= 0).sum()) * table.pools[v.pool_index].slot_bytes
                      for g in table.layer_groups for v in g.views)
        slot = segment_bound(payload)
        writers = tuple(sorted(k[1] for k in session.writers))
        lease = self.staging.lease(slot * len(writers))
        if lease is None:
            logger.warning("%s: staging buffer full, request %d goes direct", own.key, session.disagg_id)
            return None
        session.staging, session.bounce_slot, session.bounce_writers = lease, slot, writers
        return {"params": cfg.to_dict(), "ptr": lease.ptr, "slot": slot, "writers": list(writers)}

    def scatter(self, session: RecvSession, done: TransferDone) -> bool:
        """Unpack a bounced write into our KV; False (the writer's error recorded) when it cannot be."""
        try:
            if session.staging is None or done.sender[1] not in session.bounce_writers:
                raise KVTransferError(f"{done.sender} bounced request {done.disagg_id} but we offered no segment")
            index = session.bounce_writers.index(done.sender[1])
            kv_regions = RegionTable([r for r in self._local.agent.registered_regions if r != self.staging.region])
            with self._local.timed("scatter"):
                scatter(session.staging.ptr + index * session.bounce_slot, session.bounce_slot, kv_regions,
                        self.device)
            return True
        except KVTransferError as exc:
            session.errors[done.sender] = str(exc)
            return False

    def close_recv(self, session: RecvSession) -> None:
        """Return the session's staging lease; quarantine it if a writer may still write into it."""
        if session.staging is None:
            return
        if session.settled:
            self.staging.release(session.staging)
        else:
            logger.warning("%s: request %d ended with writers unsettled; %d staging bytes quarantined",
                           self._local.key, session.disagg_id, session.staging.nbytes)
        session.staging = None

    # -- sender -------------------------------------------------------------------------------
    def gather(self, session: SendSession, request: RequestData, gen: RankInfo, src: np.ndarray, dst: np.ndarray,
               sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Gather into our staging and return the single (src, dst, size) write, or None for direct."""
        offer, cfg, own = request.bounce, self._local.config.bounce, self._local.own
        if offer is None or len(sizes) == 0:
            return None
        if cfg is None or offer.get("params") != cfg.to_dict():
            logger.warning("%s: bounce parameters differ from %s's (%s vs %s); request %d goes direct",
                           own.key, gen.key, cfg and cfg.to_dict(), offer.get("params"), request.disagg_id)
            return None
        num_blocks = sum(int((b >= 0).sum()) for b in request.block_ids.values())
        if not cfg.kv_passes(num_blocks, sizes, on_device=self.device is not None):
            return None
        need = plan_segment_bytes(sizes)
        if need > offer["slot"] or own.rank not in offer["writers"]:
            logger.warning("%s: bounce segment of %d bytes does not fit %s's %d; request %d goes direct",
                           own.key, need, gen.key, offer["slot"], request.disagg_id)
            return None
        lease = self.staging.lease(need)
        if lease is None:
            return None
        with self._local.timed("gather"):
            total = gather(lease, src, dst, sizes, self.device)
        session.staging[(gen.key, 0)] = lease
        target = offer["ptr"] + offer["writers"].index(own.rank) * offer["slot"]
        return (np.array([lease.ptr], np.uint64), np.array([target], np.uint64), np.array([total], np.uint64))
