"""TLS for the cluster's HTTP: the keys that serve a process over https, and the CA its clients trust.

    orchestrator (ssl_certfile/ssl_keyfile) <──https── client, and a member's --join calls
         │  trusts ssl_ca_file
         └──https──> worker (ssl_certfile/ssl_keyfile): probes, context_only / generation_only,
                     /v1/disagg/*, each carrying X-Cluster-Token, now encrypted
    worker: trusts ssl_ca_file for its orchestrator's https url (--join)

Without TLS an observer of that traffic learns the cluster token from the orchestrator's own requests
(docs/deploy.md, "Trust model"). The KV planes (ZeroMQ, NIXL) are not HTTP and are not covered here.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def check_tls_files(ssl_keyfile: str | None, ssl_certfile: str | None, ssl_ca_file: str | None) -> None:
    """ValueError naming the key and the fix when the TLS settings cannot work."""
    if (ssl_keyfile is None) != (ssl_certfile is None):
        given, missing = ("ssl_keyfile", "ssl_certfile") if ssl_keyfile is not None else ("ssl_certfile", "ssl_keyfile")
        raise ValueError(f"{given} is set and {missing} is not: https needs both the certificate (ssl_certfile, PEM) "
                         "and its private key (ssl_keyfile, PEM)")
    for key, path in (("ssl_keyfile", ssl_keyfile), ("ssl_certfile", ssl_certfile), ("ssl_ca_file", ssl_ca_file)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{key} {path!r} is not a readable file: give the path of a PEM file")


def uvicorn_ssl(ssl_keyfile: str | None, ssl_certfile: str | None) -> dict:
    """uvicorn.Config's keyword arguments that serve https (none: plain HTTP)."""
    return {"ssl_keyfile": ssl_keyfile, "ssl_certfile": ssl_certfile} if ssl_certfile else {}


def client_verify(ssl_ca_file: str | None) -> ssl.SSLContext | bool:
    """httpx's `verify` for the cluster's https urls: this CA file, else the system's CAs."""
    return ssl.create_default_context(cafile=ssl_ca_file) if ssl_ca_file is not None else True


def scheme(ssl_certfile: str | None) -> str:
    return "https" if ssl_certfile else "http"
