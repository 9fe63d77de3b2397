"""The `pdserve` command.

    pdserve serve [MODEL] [--config worker.yaml] [--host H] [--port P]   one OpenAI-compatible instance
    pdserve convert GGUF OUT_DIR [--dtype float32]                       GGUF -> Hugging Face directory
    pdserve launch [cluster.yaml]                                        a local disaggregated cluster
    pdserve launch --ray [ADDRESS] cluster.yaml                          the same on a Ray cluster
    pdserve launch --slo ttft:MS,tpot:MS [--input-len N --output-len M]  plan the deployment, then launch it
    pdserve plan --slo ttft:MS,tpot:MS --input-len N --output-len M      the deployment for an SLO (ranked)
    pdserve scale context|generation N [--ray ADDRESS]                   resize a role of that cluster
    pdserve disaggregated -c disagg.yaml                                 the orchestrator (OpenAI API)
    pdserve bench --base-url URL --model NAME ...                        load-test any OpenAI endpoint
    pdserve bench sweep --endpoint NAME=URL ...                          goodput over a sweep of rates
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing


EXIT_ENGINE_DIED = 3  # `pdserve serve`'s exit status when its engine's step loop died


def serve_config(args: argparse.Namespace):
    """`pdserve serve`'s WorkerConfig: the YAML file, then the flags given on the command line."""
    from pdserve.config import WorkerConfig, load_yaml

    flags = {name: getattr(args, name) for name in WorkerConfig.model_fields if hasattr(args, name)}
    return load_yaml(args.config, WorkerConfig, **flags)


def _serve(args: argparse.Namespace) -> int:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.server.app import bind_listener, run_server

    cfg = serve_config(args)
    with bind_listener(cfg.host, cfg.port) as sock:
        engine = AsyncEngine.from_config(cfg, kv_events_port=cfg.kv_events_port)
        try:
            run_server(engine, cfg, sock=sock)
        finally:
            engine.shutdown()
    if engine.error:  # a supervisor restarts a process that exits; one alive at 503 it leaves alone
        logging.getLogger("pdserve.serve").error("exiting: the engine's step loop died (%s)", engine.error)
        return EXIT_ENGINE_DIED
    return 0


# Short names kept beside the generated flags (vLLM spells these the same).
_ALIASES = {"tensor_parallel_size": ["--tp"], "pipeline_parallel_size": ["--pp"]}


def _add_config_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...]) -> None:
    """One flag per scalar key of the config class (`max_num_seqs` -> `--max-num-seqs`), read as text
    and validated with the rest of the config, so a flag and its YAML key cannot drift apart. A flag
    given on the command line overrides the YAML file; nested sections are YAML only."""
    for name, field in cls.model_fields.items():
        kind = field.annotation
        if typing.get_origin(kind) in (types.UnionType, typing.Union):  # `int | None`: the flag takes the int
            options = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = options[0] if len(options) == 1 else None
        choice = typing.get_origin(kind) is typing.Literal
        numbers = typing.get_origin(kind) is list and typing.get_args(kind) == (int,)  # `--key 1 2 4`
        if name in skip or not (choice or numbers or kind in (str, int, float, bool)):
            continue
        default = "unset" if field.default is None else str(field.default).lower() if kind is bool else field.default
        help_text = field.description or ""
        if "default" not in help_text:
            help_text += ("; " if help_text else "") + f"default: {default}"
        if kind is bool:
            extra = {"action": argparse.BooleanOptionalAction}
        elif choice:
            extra = {"choices": list(typing.get_args(kind))}
        elif numbers:
            extra = {"nargs": "+", "type": int, "metavar": "N"}
        else:
            extra = {"metavar": {int: "N", float: "X", str: "TEXT"}[kind]}
        help_text = help_text.replace("%", "%%")  # argparse %-formats help
        parser.add_argument(f"--{name.replace('_', '-')}", *_ALIASES.get(name, []), dest=name,
                            default=argparse.SUPPRESS, help=help_text, **extra)


# `pdserve launch` flags that set the cluster started without --slo: its own keys, and its instances' worker keys
_CLUSTER_FLAGS = ("model", "port", "backend")
_INSTANCE_FLAGS = ("dtype", "kv_cache_dtype", "device")


def _launch(args: argparse.Namespace) -> int:
    from pdserve.plan.cli import plan_defaults

    defaults = plan_defaults()
    given = [k for k in defaults if k in vars(args)]  # the planning flags on the command line
    overrides = None
    if args.slo is not None:
        if args.cluster is not None or args.ray is not None:
            raise ValueError("--slo plans the cluster itself: give either cluster.yaml or --slo, and --slo runs "
                             "locally only (write the plan with `pdserve plan`, then `pdserve launch --ray` it)")
        from pdserve.plan.launch import planned_cluster

        for key, value in defaults.items():
            vars(args).setdefault(key, value)
        args.cluster = planned_cluster(args)
        if args.cluster is None:
            return 1
    elif given:
        overrides = _cluster_overrides(args, given)
    cluster, address = args.cluster, args.ray
    if address is not None and address.endswith((".yaml", ".yml")) and cluster is None:
        cluster, address = address, "auto"  # `--ray cluster.yaml`: no address given
    if address is not None:
        from pdserve.launch.ray_cluster import launch_ray

        return launch_ray(cluster, None if address == "auto" else address, overrides)
    from pdserve.launch.local import launch

    return launch(cluster, overrides)


def _cluster_overrides(args: argparse.Namespace, given: list[str]) -> dict:
    """What --model, --port, --backend, --dtype, --kv-cache-dtype and --device set over the cluster (the
    cluster.yaml's, or the default one context + one generation instance). Before, without --slo they were
    ignored: `pdserve launch --model DIR` served the default model."""
    planning = [k for k in given if k not in _CLUSTER_FLAGS + _INSTANCE_FLAGS]
    if planning:
        raise ValueError(f"--{planning[0].replace('_', '-')} is for planning the deployment: add --slo ttft:MS,tpot:MS")
    instance = {k: getattr(args, k) for k in _INSTANCE_FLAGS if k in given}
    if instance and args.cluster is not None:
        raise ValueError(f"--{next(iter(instance)).replace('_', '-')} would set every instance of {args.cluster}: "
                         "set it in each instance's config there")
    out = {k: getattr(args, k) for k in _CLUSTER_FLAGS if k in given}
    if instance:
        out["context"] = out["generation"] = [{"config": instance}]
    return out


def _scale(args: argparse.Namespace) -> int:
    from pdserve.launch.ray_cluster import scale

    return scale(args.role, args.n, args.ray)


def _convert(args: argparse.Namespace) -> int:
    import torch

    from pdserve.weights.gguf_convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve one model over an OpenAI-compatible HTTP API",
                       description="Serve one model over an OpenAI-compatible HTTP API. Every flag below is also "
                                   "a key of the YAML config (docs/configuration.md); a flag overrides the file.")
    s.add_argument("model", nargs="?", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--config", "-c", default=None, help="worker YAML config (see docs/configuration.md)")
    from pdserve.config import WorkerConfig

    _add_config_flags(s, WorkerConfig, skip=("model",))
    s.set_defaults(func=_serve)

    c = sub.add_parser("convert", help="write a GGUF model as a Hugging Face directory (safetensors)")
    c.add_argument("gguf", help="path to the .gguf file")
    c.add_argument("out_dir", help="output directory")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.set_defaults(func=_convert)
    sub.add_parser("bench", help="load-test an OpenAI endpoint (pdserve bench --help)")
    sub.add_parser("disaggregated", help="the disaggregated orchestrator (pdserve disaggregated --help)")
    sub.add_parser("plan", help="the deployment that serves the most within an SLO here (pdserve plan --help)")
    la = sub.add_parser("launch", help="start a local disaggregated cluster (default: 1 context + 1 generation)")
    la.add_argument("cluster", nargs="?", default=None, help="cluster.yaml (see docs/launch.md)")
    la.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                    help="run the cluster on Ray: the cluster at ADDRESS (host:port), else the one found here, "
                         "else a one-node Ray started here (docs/deploy.md; pip install 'pdserve[ray]')")
    from pdserve.plan.cli import add_plan_arguments

    add_plan_arguments(la.add_argument_group("--slo: plan the deployment first (pdserve plan --help); without it, "
                                             "--model, --port, --backend, --dtype, --kv-cache-dtype and --device "
                                             "set the cluster"), slo_required=False, defaults=False)
    la.set_defaults(func=_launch)
    sc = sub.add_parser("scale", help="resize a role of a `pdserve launch --ray` cluster while it serves")
    sc.add_argument("role", choices=["context", "generation"])
    sc.add_argument("n", type=int, help="instances the role should have")
    sc.add_argument("--ray", default=None, metavar="ADDRESS", help="the Ray cluster (default: the one found here)")
    sc.set_defaults(func=_scale)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `pdserve --log-level X disaggregated ...`: the global flag goes to the subcommand that owns its list.
    lead: list[str] = []
    if argv[:1] == ["--log-level"] and len(argv) > 2:
        lead, argv = argv[:2], argv[2:]
    elif argv[:1] and argv[0].startswith("--log-level=") and len(argv) > 1:
        lead, argv = argv[:1], argv[1:]
    if argv[:1] not in (["bench"], ["disaggregated"], ["plan"]):
        argv = lead + argv
    if argv[:1] == ["bench"]:  # these own their argument lists
        from pdserve.bench.cli import main_bench

        return main_bench(argv[1:])
    if argv[:1] == ["plan"]:
        from pdserve.plan.cli import main_plan

        return main_plan(argv[1:])
    if argv[:1] == ["disaggregated"]:
        from pdserve.orchestrator.cli import main_disaggregated

        return main_disaggregated(argv[1:] + lead)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
