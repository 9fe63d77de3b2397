"""KVTransceiver: the API an engine executor drives to move a request's KV between instances.

One transceiver per rank. Setup (every rank of both instances)::

    agent = make_agent(config.backend); agent.register_memory(MemoryRegion.of_tensor(kv_pool))
    tx = KVTransceiver(agent, TransceiverConfig(...), host=advertised_host)
    info = RankInfo(..., agent_descriptor=tx.local_descriptor(), control_endpoint=tx.endpoint)
    tx.start(info, instance_ranks)          # instance_ranks: all RankInfos of this instance (allgather)

Context side: `respond_and_send_async(rid, block_ids)` then poll `check_context_transfer_status()`;
free the KV of requests it reports. Pipelined: call it once per prefill chunk with that chunk's
blocks (`chunking.chunk_blocks`) and `last=False` until the final chunk; each chunk is written to
every requester as soon as both the chunk and its REQUEST_DATA are here.

Generation side: `request_and_receive_async(rid, ctx_endpoint, block_ids)` then poll
`check_gen_transfer_status()`; resume decoding of requests it reports.
An executor with transfers in flight and nothing else to do sleeps in `wait(timeout_s)`, which the
control plane and the agent (a finished write, a notification) end early; `check_*_status(at_least=n)`
waits the same way, never in a fixed sleep-and-check loop.
`cancel_request(rid)` is False while a write may still land (retry next step) and True once the
blocks may be reused. See sessions.py for the lifecycles. Each status is this rank's: the executor
agrees across its ranks before it changes a request's state.

Threads: the ZeroMQ listener only answers RankInfo requests from immutable state and enqueues
everything else; all session state and every agent call live on the caller's (executor) thread.
Address arithmetic happens only on the sender (`write_plan.plan_write`); the receiver derives just
which ctx ranks will write to it (`write_plan.writers_for`), and re-runs the sender's plan only to
check KV checksums (integrity.py).

The parts, one noun each:
    kv_transceiver.py KVTransceiver, the API above, over the parts below
    base.py           TransceiverConfig, and the rank state every part shares
    sender.py         the context side: send sessions, parked REQUEST_DATA, cancels, the writes
    receiver.py       the generation side: receive sessions, the first-contact canary gate
    control_plane.py  the listener's queue, draining it into the two sides, context instances' RankInfos
    bouncer.py        the staging buffer and the bounce steps of both sides
"""

from pdserve.kv_transfer.transceiver.base import TransceiverConfig
from pdserve.kv_transfer.transceiver.kv_transceiver import HOUSEKEEPING_S, KVTransceiver

__all__ = ["HOUSEKEEPING_S", "KVTransceiver", "TransceiverConfig"]
