"""The cluster token over HTTP: who may use a cluster's internal endpoints, and how a member proves it
holds the token without sending it (docs/deploy.md, "Trust model").

    member ──POST /cluster/join {role, url}───── X-Cluster-Proof: HMAC(token, join|role|url) ──> orchestrator
    orchestrator ──GET url/v1/disagg_info──────── X-Cluster-Nonce: N (fresh, random) ──────────> member
             <── {..., "cluster_proof": HMAC(token, member|N)} ───────────────────────────────  (else refused)
    member ──POST /cluster/heartbeat, /leave {url}── X-Cluster-Proof: HMAC(token, heartbeat|url) ...
    orchestrator ──context_only / generation_only / /v1/disagg/*── X-Cluster-Token: token ──> a proven member

The joiner proves it holds the token for the url it names, and the instance at that url proves it
holds the token too, before the orchestrator routes a request (with the token) to it. A member only
ever sends HMACs, so an orchestrator that is not the cluster's learns nothing it can reuse. HMAC-SHA256
over length-prefixed parts, the purpose first, so a proof for one purpose is no proof for another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_HEADER = "X-Cluster-Token"
PROOF_HEADER = "X-Cluster-Proof"
NONCE_HEADER = "X-Cluster-Nonce"
_DOMAIN = "pdserve-cluster-v1"
_MAX_NONCE_CHARS = 128  # what a member signs: the orchestrator's nonces are 32 hex characters


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
    if not nonce or len(nonce) > _MAX_NONCE_CHARS:
        return None
    return proof(token, "member", nonce)
