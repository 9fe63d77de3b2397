"""The cluster token over HTTP: who may use a cluster's internal endpoints, and how a member proves it
holds the token without sending it (docs/deploy.md, "Trust model").

    member ──POST /cluster/join {role, url}── X-Cluster-Proof: HMAC(token, join|role|url|T|n) ──> orchestrator
                                              X-Cluster-Proof-Time: T (the member's clock, unix s)
                                              X-Cluster-Proof-Nonce: n (fresh, random)
    orchestrator ──GET url/v1/disagg_info──────── X-Cluster-Nonce: N (fresh, random) ──────────> member
             <── {..., "cluster_proof": HMAC(token, member|N)} ───────────────────────────────  (else refused)
    member ──POST /cluster/heartbeat, /leave {url}── X-Cluster-Proof: HMAC(token, heartbeat|url|T|n) ...
    orchestrator ──context_only / generation_only / /v1/disagg/*── X-Cluster-Token: token ──> a proven member

The joiner proves it holds the token for the url it names, and the instance at that url proves it
holds the token too, before the orchestrator routes a request (with the token) to it. A member only
ever sends HMACs, so an orchestrator that is not the cluster's learns nothing it can reuse. HMAC-SHA256
over length-prefixed parts, the purpose first, so a proof for one purpose is no proof for another.

A member's proof is good once, within PROOF_WINDOW_S of its time T on the orchestrator's clock (that
much clock skew between hosts is allowed): the orchestrator remembers each nonce n until T leaves the
window (`SeenNonces`, or etcd where the membership is kept there), so a proof captured on the wire and
replayed is refused, within the window as a replay and after it as too old.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Mapping

TOKEN_HEADER = "X-Cluster-Token"
PROOF_HEADER = "X-Cluster-Proof"
NONCE_HEADER = "X-Cluster-Nonce"
PROOF_TIME_HEADER = "X-Cluster-Proof-Time"
PROOF_NONCE_HEADER = "X-Cluster-Proof-Nonce"
# How far a proof's time may be from the orchestrator's clock, either way: the clock skew allowed
# between hosts, and how long a nonce is remembered (at most twice this).
PROOF_WINDOW_S = 60.0
MAX_SEEN_NONCES = 100_000  # per process: 2 * PROOF_WINDOW_S of heartbeats from about 2,700 members
_DOMAIN = "pdserve-cluster-v1"
MAX_NONCE_CHARS = 128  # what a member signs: the orchestrator's nonces are 32 hex characters


def proof(token: str, purpose: str, *parts: str) -> str:
    """HMAC-SHA256(token, purpose and parts), hex."""
    msg = "".join(f"{len(p)}:{p}" for p in (_DOMAIN, purpose, *parts)).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def proof_ok(token: str, presented: str | None, purpose: str, *parts: str) -> bool:
    if not presented:
        return False
    return hmac.compare_digest(presented.encode(errors="replace"), proof(token, purpose, *parts).encode())


def token_ok(token: str, presented: str | bytes | None) -> bool:
    """`presented` is the token itself (an X-Cluster-Token header)."""
    if not presented:
        return False
    if isinstance(presented, str):
        presented = presented.encode(errors="replace")
    return secrets.compare_digest(presented, token.encode())


def new_nonce() -> str:
    return secrets.token_hex(16)


def member_proof(token: str, nonce: str) -> str | None:
    """A member's answer to the orchestrator's challenge `nonce`; None for a nonce no orchestrator sends."""
    if not nonce or len(nonce) > MAX_NONCE_CHARS:
        return None
    return proof(token, "member", nonce)


class ProofRefused(Exception):
    """A member's proof that is no proof; the message says why and what to fix."""


class WrongToken(ProofRefused):
    """The proof is not an HMAC with this cluster's token."""


@dataclass(frozen=True)
class FreshProof:
    """A proof whose HMAC and time are good: it is taken once its nonce proves unseen for remember_s."""

    nonce: str
    remember_s: float  # until the proof's time leaves the window: a replay before then must be caught


def signed_headers(token: str, purpose: str, *parts: str, now: float | None = None) -> dict[str, str]:
    """A member's headers for one call: its proof over purpose, parts, the time and a fresh nonce."""
    stamp, nonce = f"{time.time() if now is None else now:.3f}", new_nonce()
    return {PROOF_HEADER: proof(token, purpose, *parts, stamp, nonce), PROOF_TIME_HEADER: stamp,
            PROOF_NONCE_HEADER: nonce}


def check_proof(token: str, headers: Mapping[str, str], purpose: str, *parts: str, now: float | None = None,
                window_s: float = PROOF_WINDOW_S) -> FreshProof:
    """The proof in `headers` (signed_headers'), checked but for its nonce's freshness (the caller asks
    the nonce store); ProofRefused saying why otherwise."""
    presented, stamp, nonce = (headers.get(h) for h in (PROOF_HEADER, PROOF_TIME_HEADER, PROOF_NONCE_HEADER))
    if not stamp or not nonce or len(nonce) > MAX_NONCE_CHARS:
        raise ProofRefused(f"a member's proof must carry {PROOF_TIME_HEADER} and {PROOF_NONCE_HEADER} (a pdserve "
                           "older than this orchestrator sends none: run the same pdserve version on both)")
    if not proof_ok(token, presented, purpose, *parts, stamp, nonce):
        raise WrongToken("the proof is not made with this orchestrator's cluster_token")
    try:
        signed_at = float(stamp)
    except ValueError:
        raise ProofRefused(f"{PROOF_TIME_HEADER} {stamp[:40]!r} is not a unix time") from None
    now = time.time() if now is None else now
    if not math.isfinite(signed_at) or abs(now - signed_at) > window_s:
        lag = now - signed_at
        off = f"{abs(lag):.0f} s {'behind' if lag > 0 else 'ahead of'}" if math.isfinite(lag) \
            else f"{stamp[:40]}, not near"
        raise ProofRefused(f"the proof's time is {off} this orchestrator's clock, beyond the {window_s:g} s a proof "
                           "is good for: a replayed proof, or clock skew between the member's host and the "
                           "orchestrator's (keep their clocks in sync, e.g. with NTP)")
    return FreshProof(nonce, max(1.0, signed_at + window_s - now))


class NoncesFull(Exception):
    """More unexpired nonces than a process keeps: a flood of membership calls, refused until some expire."""


class SeenNonces:
    """The nonces of the proofs taken within their window, in this process's memory, bounded: a nonce is
    kept until its proof's time leaves the window, and when MAX_SEEN_NONCES are kept a new one is refused
    (NoncesFull), never taken by forgetting one that could still be replayed."""

    def __init__(self, max_entries: int = MAX_SEEN_NONCES, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.clock = max_entries, clock
        self._until: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._expiry: list[tuple[float, str]] = []  # a heap of (until, nonce)

    def first_use(self, nonce: str, remember_s: float) -> bool:
        """True and remember `nonce` for remember_s when it is new; False when it was seen (a replay)."""
        now = self._forget_expired()
        if nonce in self._until:
            return False
        if len(self._until) >= self.max_entries:
            raise NoncesFull(f"{len(self._until)} membership proofs taken in the last {2 * PROOF_WINDOW_S:g} s, "
                             "the most this orchestrator remembers: retry in a few seconds")
        self._until[nonce] = now + remember_s
        heapq.heappush(self._expiry, (now + remember_s, nonce))
        return True

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._until)

    def _forget_expired(self) -> float:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            until, old = heapq.heappop(self._expiry)
            if self._until.get(old) == until:
                del self._until[old]
        return now
