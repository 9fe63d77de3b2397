"""A real etcd for tests and benchmarks (`cluster_storage: etcd://...`): Debian's etcd-server."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from pdserve.host import free_port


class EtcdMissing(RuntimeError):
    pass


class EtcdServer:
    """A real etcd (Debian's etcd-server) on two free loopback ports, its data in `workdir`; stopped by pid."""

    def __init__(self, workdir: Path):
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing("etcd is not installed: apt-get install etcd-server (scripts/install test does)")
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.storage = f"etcd://127.0.0.1:{self.port}"
        self.log_path = workdir / "etcd.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [binary, "--name", "pdserve-test", "--data-dir", str(workdir / "etcd-data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"pdserve-test=http://127.0.0.1:{peer}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not start:\n{self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
