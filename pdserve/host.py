"""Host utilities shared by launch, plan, testing and benchmarks: what a process needs of the machine it
runs on, nothing about models or serving."""

from __future__ import annotations

import os
import random
import signal
import socket
from pathlib import Path

from pdserve.env import settings

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec (Linux): the kernel sends it `sig` when the process that started it
    dies, by any signal, SIGKILL included; otherwise a killed launcher would leave its servers running."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds the cluster token), whatever was there before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


_handed_out: set[int] = set()


def no_named_semaphores() -> None:
    """For a spawned child that starts no processes itself (a rank, a profiling child). A spawned
    child's default start method is spawn, under which each multiprocessing lock is a named POSIX
    semaphore in /dev/shm that only the parent's resource tracker unlinks; kill -9 of the whole process
    group (a launch that gave up waiting for its members, a test's teardown) takes the tracker too and
    leaves the semaphores behind. tqdm makes one such lock on first use, for disabled bars too: give it
    a thread lock."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def host_id() -> str:
    """Which host (kernel) this process runs on, for "can these two share memory?": hostname and boot id.
    Two containers of one machine differ by hostname, as their /dev/shm usually does; two Ray nodes
    started on one machine agree. PDSERVE_HOST_ID overrides it (containers that do share /dev/shm)."""
    override = settings().host_id
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their local port there)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now, for a server that binds it a moment later.

    Picked below the kernel's ephemeral range: a port the OS hands out for `bind(0)` lies in that range,
    where any outgoing connection in the meantime (a rank dialling its peers, a client) can take it
    before the server binds. Ports handed out earlier in this process are not handed out again."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a machine with nothing free below the range: let the OS choose
        s.bind((host, 0))
        return s.getsockname()[1]
