"""Membership under load: instances that join, drain, die and come back while clients keep sending,
then a table of the times and of every request that did not get the right answer.

    python benchmarks/membership_churn.py [--concurrency 4] [--lease-ttl 3] [--phase-s 6] [--etcd]

Over a tiny random-weight model (shm transfers): an orchestrator whose config lists no instance, with
`--etcd` its membership in a real etcd started here; one context and one generation instance that join
by themselves (`join` + `role`). Closed-loop clients send short greedy requests the whole time; each
answer is right (the generation instance's own aggregated output for that prompt), wrong, or an error.
Then, `--phase-s` apart:

    scale up     a second context instance starts: time to joined, and to its first routed request
    kill -9      it is killed: time until the orchestrator notices (out of routing) and until its lease
                 is lost and it is dropped
    restart      it starts again on the same port: time to its first routed request again
    scale down   the first context instance gets SIGTERM (drain, leave): time until out of routing
    gen scale up, gen scale down: the same for a second generation instance, then the first one
    orchestrator (with --etcd) the orchestrator is killed with -9 and started again: time to serving

A request is counted in the phase during which its answer (or error) came.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from fault_suite import WORKER, Proc, prompt_for, wait_ready  # noqa: E402

from pdserve.host import free_port  # noqa: E402
from pdserve.testing import make_tiny_model  # noqa: E402
from pdserve.testing.etcd import EtcdServer  # noqa: E402

BODY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Cluster:
    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.model_dir = make_tiny_model(workdir / "tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                                         max_position_embeddings=512)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.etcd: EtcdServer | None = None
        self.orch: Proc | None = None

    def start_orchestrator(self, storage: str | None) -> None:
        cfg = {"port": self.port, "lease_ttl_s": self.args.lease_ttl, "health_check_interval": 0.5,
               "max_retries": 1, **({"cluster_storage": storage} if storage else {})}
        path = self.workdir / "disagg.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.orch = Proc(["disaggregated", "-c", str(path)], self.workdir / f"orchestrator-{time.time():.0f}.log")

    def start_worker(self, role: str, port: int | None = None) -> tuple[Proc, str]:
        port = port or free_port()
        cfg = {**WORKER, "join": self.url, "role": role, "cache_transceiver_config": {"backend": "shm"}}
        path = self.workdir / f"worker-{port}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = Proc(["serve", str(self.model_dir), "--port", str(port), "--config", str(path)],
                    self.workdir / f"worker-{port}-{time.time():.0f}.log")
        return proc, f"http://127.0.0.1:{port}"

    async def routed(self, http: httpx.AsyncClient, role: str) -> dict[str, bool] | None:
        """url -> ready, as the orchestrator routes now (None: it did not answer)."""
        try:
            info = (await http.get(self.url + "/cluster_info", timeout=2)).json()
        except (httpx.HTTPError, ValueError):
            return None
        return {i["url"]: i["ready"] for i in info[f"{role}_servers"]["instances"]}


async def served(http: httpx.AsyncClient, url: str) -> float:
    """Requests a worker has finished (its /metrics), 0 while it does not answer."""
    try:
        text = (await http.get(url + "/metrics", timeout=2)).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^pdserve_request_success_total\{[^}]*\} (\S+)$", text, re.M))


async def until(cond, timeout_s: float, poll_s: float = 0.05) -> float | None:
    """Seconds until `await cond()` is true, or None after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await cond():
            return time.monotonic() - start
        await asyncio.sleep(poll_s)
    return None


async def run(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-churn-"))
    cluster = Cluster(args, workdir)
    if args.etcd:
        cluster.etcd = EtcdServer(workdir)
    storage = cluster.etcd.storage if cluster.etcd else None
    cluster.start_orchestrator(storage)
    procs: list[Proc] = []
    phase = ["warm-up"]
    outcomes: list[tuple[str, str]] = []  # (phase when the answer came, right | wrong | "error ...")
    times: list[tuple[str, str]] = []
    stop = asyncio.Event()
    try:
        (ctx1, ctx1_url), (gen, gen_url) = cluster.start_worker("context"), cluster.start_worker("generation")
        procs += [ctx1, gen]
        wait_ready(cluster.url, timeout=120)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            prompts = [prompt_for(i) for i in range(20)]
            reference = [(await http.post(gen_url + "/v1/completions", json={**BODY, "prompt": p})).json()
                         ["choices"][0]["text"] for p in prompts]

            async def client(k: int) -> None:
                i = k
                while not stop.is_set():
                    p = i % len(prompts)
                    try:
                        r = await http.post(cluster.url + "/v1/completions", json={**BODY, "prompt": prompts[p]})
                        if r.status_code != 200:
                            outcomes.append((phase[0], f"error {r.status_code}: {r.json()['error']['code']}"))
                        else:
                            outcomes.append((phase[0], "right" if r.json()["choices"][0]["text"] == reference[p]
                                             else "wrong"))
                    except (httpx.HTTPError, ValueError, KeyError) as e:
                        outcomes.append((phase[0], f"error: {type(e).__name__}: {str(e)[:60]}"))
                        await asyncio.sleep(0.05)  # the orchestrator is down: do not spin
                    i += args.concurrency

            clients = [asyncio.ensure_future(client(k)) for k in range(args.concurrency)]
            await asyncio.sleep(args.phase_s)

            async def scale_up(name: str, role: str, port: int | None = None) -> tuple[Proc, str]:
                """Start an instance; time to its first routed request (and to joined and ready)."""
                started = time.monotonic()
                proc, url = cluster.start_worker(role, port)
                procs.append(proc)
                joined = await until(lambda: _ready(cluster, http, url, role), 120)
                first = await until(lambda: _gt(served(http, url), 0), 60)
                if port is None and role == "context":
                    times.append((f"{name}: start -> joined and ready", _s(joined)))
                times.append((f"{name}: start -> first routed request", _s(first and time.monotonic() - started)))
                return proc, url

            async def scale_down(name: str, proc: Proc, url: str, role: str) -> None:
                """SIGTERM (drain, leave): time until out of routing; then the process exits."""
                proc.proc.send_signal(signal.SIGTERM)
                out = await until(lambda: _gone(cluster, http, url, role), 30)
                times.append((f"{name}: SIGTERM -> out of routing", _s(out)))
                await asyncio.to_thread(proc.proc.wait, 60)

            phase[0] = "scale up"
            ctx2, ctx2_url = await scale_up("scale up", "context")
            await asyncio.sleep(args.phase_s)

            phase[0] = "kill -9"
            ctx2.kill()
            noticed = await until(lambda: _not_ready(cluster, http, ctx2_url), 30)
            lost = await until(lambda: _gone(cluster, http, ctx2_url), 4 * args.lease_ttl)
            times.append(("kill -9: kill -> out of routing (probe)", _s(noticed)))
            times.append(("kill -9: kill -> lease lost, dropped", _s(noticed is not None and lost is not None
                                                                     and noticed + lost)))
            phase[0] = "restart"
            ctx2, _ = await scale_up("restart", "context", int(ctx2_url.rsplit(":", 1)[1]))
            await asyncio.sleep(args.phase_s)

            phase[0] = "scale down"
            await scale_down("scale down", ctx1, ctx1_url, "context")
            await asyncio.sleep(args.phase_s)

            phase[0] = "gen scale up"
            await scale_up("generation scale up", "generation")
            await asyncio.sleep(args.phase_s)

            phase[0] = "gen scale down"
            await scale_down("generation scale down", gen, gen_url, "generation")
            await asyncio.sleep(args.phase_s)

            if args.etcd:
                phase[0] = "orchestrator -9"
                cluster.orch.kill()
                cluster.start_orchestrator(storage)
                back = await until(lambda: _health(http, cluster.url), 60)
                times.append(("orchestrator killed -9, restarted: start -> /health 200", _s(back)))
                await asyncio.sleep(args.phase_s)
            stop.set()
            await asyncio.gather(*clients)
    finally:
        stop.set()
        for p in [*procs, cluster.orch]:
            if p is not None:
                p.kill(signal.SIGTERM)
        if cluster.etcd is not None:
            cluster.etcd.stop()
    report(args, outcomes, times)


async def _ready(cluster, http, url, role: str = "context") -> bool:
    return ((await cluster.routed(http, role)) or {}).get(url, False)


async def _not_ready(cluster, http, url) -> bool:
    routed = await cluster.routed(http, "context")
    return routed is not None and not routed.get(url, False)


async def _gone(cluster, http, url, role: str = "context") -> bool:
    routed = await cluster.routed(http, role)
    return routed is not None and url not in routed


async def _gt(value, threshold) -> bool:
    return (await value) > threshold


async def _health(http, url) -> bool:
    try:
        return (await http.get(url + "/health", timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


def _s(value) -> str:
    return "-" if value is None or value is False else f"{value:.2f} s"


def report(args, outcomes, times) -> None:
    print(f"\nmembership churn: {args.concurrency} clients, lease_ttl_s {args.lease_ttl}, "
          f"{'etcd' if args.etcd else 'built-in'} store\n")
    print("| event | time |\n|---|---|")
    for name, value in times:
        print(f"| {name} | {value} |")
    print("\n| phase | requests | right | wrong | errors |\n|---|---|---|---|---|")
    phases = list(dict.fromkeys(p for p, _ in outcomes))
    for p in phases:
        kinds = Counter(k for q, k in outcomes if q == p)
        errors = sum(n for k, n in kinds.items() if k.startswith("error"))
        print(f"| {p} | {sum(kinds.values())} | {kinds['right']} | {kinds['wrong']} | {errors} |")
    for p in phases:
        errors = Counter(k for q, k in outcomes if q == p and k.startswith("error"))
        if errors:
            print(f"\nerrors in {p}: " + ", ".join(f"{k} x{n}" for k, n in errors.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lease-ttl", type=float, default=3.0)
    ap.add_argument("--phase-s", type=float, default=6.0, help="seconds of load between two events")
    ap.add_argument("--etcd", action="store_true", help="the membership in a real etcd (Debian's etcd-server)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
