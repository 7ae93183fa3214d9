"""Command line: ``osdp plan | simulate | demo``.

Every bad input ends in one line on stderr (``osdp: error: ...``) and exit status 2;
no traceback.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import OSDPError


def _model_desc(args):
    if getattr(args, "hf_config", None):
        return _hf_model_desc(args)
    from ..models import GPTConfig, get_preset
    from ..planner.gpt_desc import describe_gpt

    shape = dict(num_layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    given = {k: v for k, v in shape.items() if v is not None}
    if args.preset:
        base = get_preset(args.preset)
        name = args.preset
    elif given:
        base = GPTConfig(num_layers=1, hidden=1024, heads=16, seq_len=1024, vocab_size=50257)
        name = None
    else:
        base, name = get_preset(DEFAULT_PRESET), DEFAULT_PRESET
    fields = dict(base.__dict__)
    fields.update(given)
    if args.block_hidden:
        fields["block_hidden"] = _int_list(args.block_hidden, "--block-hidden")
    elif "num_layers" in given or "hidden" in given:
        fields["block_hidden"] = ()
    try:
        config = GPTConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise OSDPError(str(exc)) from None
    label = name if name and not given else f"GPT-{config.num_layers}x{config.hidden}"
    return describe_gpt(config, dtype_bytes=args.dtype_bytes, name=label)


def _hf_model_desc(args):
    """--hf-config: a Hugging Face config.json (or a shipped name) built on the meta
    device and described on fake tensors; described once per command."""
    if getattr(args, "_hf_desc", None) is not None:
        return args._hf_desc
    shape_flags = {"--preset": args.preset, "--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads,
                   "--vocab": args.vocab, "--block-hidden": args.block_hidden}
    clash = [flag for flag, value in shape_flags.items() if value is not None]
    if clash:
        raise OSDPError(f"--hf-config gives the model's shape; drop {', '.join(clash)} (--seq and --dtype-bytes apply)")
    from ..models.hf_config import describe_hf_config

    args._hf_desc = describe_hf_config(args.hf_config, seq_len=args.seq, dtype_bytes=args.dtype_bytes)
    return args._hf_desc


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1024,4096' -> (1024, 4096); anything else is one clear error."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        bad = next(p for p in parts if not (p.isdigit() and int(p) > 0))
        raise OSDPError(f"{flag} takes comma-separated positive integers (one width per block, e.g. "
                        f"1024,4096,1024), got {text!r} ({bad!r} is not one)")
    return tuple(int(p) for p in parts)


def _device(args):
    """The cost model's input: the --cluster profile (hardware) for the run that
    --world-size and --memory describe (defaults: one node, all of a device's memory)."""
    from ..planner.cluster import load_cluster
    from ..planner.run import RunSettings
    from ..sizes import parse_bytes

    cluster = load_cluster(args.cluster)
    if args.world_size is not None and args.world_size < 1:
        raise OSDPError(f"--world-size must be a positive integer, got {args.world_size}")
    memory = parse_bytes(args.memory, "--memory") if args.memory is not None else None
    return cluster.for_run(RunSettings(world_size=args.world_size or cluster.node_size, memory_limit_bytes=memory))


def _settings(args):
    from ..planner.cost_model import PlannerSettings

    if args.max_slices < 1:
        raise OSDPError(f"--max-slices must be >= 1, got {args.max_slices}")
    return PlannerSettings(
        max_slices=args.max_slices,
        checkpointing=args.checkpointing,
        param_dtype_bytes=2 if args.mixed_precision else None,
        reduce_dtype_bytes=4 if args.mixed_precision else None,
        gradient_sync=args.gradient_sync,
        layout=getattr(args, "layout", "full"),
    )


DEFAULT_PRESET = "nd-48x1024"


def cmd_plan(args) -> int:
    from ..planner.plan import Plan, check_writable
    from ..planner.planner import make_plan
    from ..sizes import format_bytes

    # refuse an output path before the (possibly long) planning, and before writing anything
    for flag, path, what in (("--json", args.json, "plan"), ("--plot", args.plot, "plot")):
        if path:
            try:
                check_writable(path, what)
            except OSDPError as exc:
                raise OSDPError(f"{flag}: {exc}") from None
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        if args.batch is not None and args.batch < 1:
            raise OSDPError(f"--batch must be a positive integer, got {args.batch}")
        if args.global_batch is not None and args.batch is not None:
            raise OSDPError("give --batch (per device) or --global-batch (per optimizer step), not both")
        plan = make_plan(_model_desc(args), _device(args), _settings(args), batch=args.batch, backend=args.backend,
                         global_batch=args.global_batch)
    print(plan)
    speedup = plan.speedup_over_fsdp
    if speedup is not None:
        print(f"\npredicted speedup over FSDP (full shard) at {format_bytes(plan.memory_limit_bytes)}: {speedup:.2f}x")
    elif "fsdp" in plan.baselines:
        at = f" and batch {args.batch}" if args.batch is not None and not args.plan else ""
        print(f"\nFSDP (full shard) does not fit at this memory limit{at}; OSDP does")
    ddp = plan.baselines.get("ddp")
    if ddp is not None:
        ratio = plan.predicted.samples_per_s / ddp.samples_per_s
        print(f"predicted speedup over DDP (every unit replicated): {ratio:.2f}x")
    print(f"search time: {plan.search_s:.3f} s")
    if args.json:
        plan.save(args.json)
        print(f"plan written to {args.json}")
    if args.plot:
        from .plot import plot_plan

        model_given = not args.plan or args.preset or args.layers or args.hf_config
        plot_plan(plan, args.plot, *((_model_desc(args), _device(args)) if model_given else ()))
        print(f"plot written to {args.plot}")
    return 0


def cmd_simulate(args) -> int:
    from ..planner.cluster import DEFAULT_CLUSTER as DEFAULT_CLUSTER_NAME
    from .simulate import run_simulation

    if args.scale:
        return _simulate_scale(args)

    if args.world_size is not None and args.world_size < 1:
        raise OSDPError(f"--world-size must be a positive integer, got {args.world_size}")
    if args.paper:
        from .simulate import run_paper

        command = "osdp simulate --paper" + ("" if args.cluster == DEFAULT_CLUSTER_NAME else f" --cluster {args.cluster}") \
            + ("" if args.world_size is None else f" --world-size {args.world_size}")
        print(run_paper(cluster=args.cluster, backend=args.backend, world_size=args.world_size, command=command))
        return 0
    print(run_simulation(cluster=args.cluster, backend=args.backend, quick=args.quick, world_size=args.world_size))
    return 0


def _simulate_scale(args) -> int:
    """``osdp simulate --scale``: see osdp/cli/scale.py."""
    from .scale import SCALE_MODELS, SCALE_PROFILES, SCALE_WORLDS, run_scale

    profiles = tuple(args.scale_clusters.split(",")) if args.scale_clusters else SCALE_PROFILES
    models = tuple(args.scale_models.split(",")) if args.scale_models else SCALE_MODELS
    worlds = SCALE_WORLDS
    if args.scale_worlds:
        parts = [p.strip() for p in args.scale_worlds.split(",")]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise OSDPError(f"--scale-worlds takes comma-separated GPU counts, e.g. 16,64, got {args.scale_worlds!r}")
        worlds = tuple(int(p) for p in parts)
    print(run_scale(out_dir=args.out, profiles=profiles, models=models, worlds=worlds, backend=args.backend,
                    seq_len=args.seq))
    if args.out:
        print(f"tables and plots written to {args.out}/scale_<cluster>.txt and .svg")
    return 0


def _add_model_flags(p):
    g = p.add_argument_group("model (a preset, a GPT shape, or a Hugging Face config)")
    g.add_argument("--preset", help=f"named model config (default {DEFAULT_PRESET}); see `osdp presets`")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seq", type=int)
    g.add_argument("--vocab", type=int)
    g.add_argument("--block-hidden", help="comma-separated per-block widths (inconsistent & consecutive models)")
    g.add_argument("--dtype-bytes", type=int, default=4, choices=(2, 4), help="bytes per weight element (default 4: fp32)")
    g.add_argument("--hf-config", metavar="CONFIG",
                   help="a Hugging Face config.json, or a shipped one by name (gpt2, llama-2-7b, llama-2-13b, "
                        "llama-2-70b, llama-3-8b, llama-3-70b, mistral-7b, mixtral-8x7b; see osdp/configs/hf/): the "
                        "model is built on the meta device and described on fake tensors, nothing downloaded or "
                        "allocated; "
                        "--seq sets tokens per sample (default: its context length, at most 4096)")


def _add_cluster_flag(g):
    from ..planner.cluster import DEFAULT_CLUSTER

    g.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"hardware profile: a shipped name (see osdp/profiles/) or a JSON file (default {DEFAULT_CLUSTER})")


def _add_world_size_flag(g):
    g.add_argument("--world-size", type=int, help="data-parallel ranks (default: one node, the profile's node_size)")


def _add_cluster_flags(p):
    g = p.add_argument_group("cluster (hardware) and run (world size, memory limit)")
    _add_cluster_flag(g)
    _add_world_size_flag(g)
    g.add_argument("--memory", help="memory limit per device with a unit, e.g. 8GiB or 16GB; units: B, KB, MB, GB, TB "
                                    "(powers of 1000), KiB, MiB, GiB, TiB (powers of 1024) (default: all of a device's "
                                    "memory, the profile's device_memory_bytes)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osdp", description="Optimal Sharded Data Parallel for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model on a cluster and show the predicted speedup over FSDP")
    _add_model_flags(p)
    _add_cluster_flags(p)
    p.add_argument("--batch", type=int, help="batch size per device (default: sweep for the most samples/s); "
                                             "the FSDP baselines are then evaluated at the same batch")
    p.add_argument("--max-slices", type=int, default=16, help="largest split granularity (1 disables splitting)")
    p.add_argument("--checkpointing", default="none", choices=("none", "auto", "all"),
                   help="activation checkpointing: none, per block chosen by the planner, or every block")
    p.add_argument("--layout", default="full", choices=("full", "hsdp", "auto"),
                   help="full: shard over all ranks (hpz re-gathers within nodes); hsdp: shard within a node, "
                        "replicate across nodes (run on a 2-D mesh); auto: the faster of the two")
    p.add_argument("--mixed-precision", action="store_true",
                   help="gather and compute in 16-bit (bf16/fp16), reduce gradients in fp32, fp32 master shards")
    p.add_argument("--global-batch", type=int,
                   help="samples per optimizer step across ranks: picks micro-batch size and accumulation steps")
    p.add_argument("--gradient-sync", default="last", choices=("every", "last"),
                   help="with accumulation: reduce-scatter after every micro-batch, or only after the last")
    p.add_argument("--json", help="write the plan to this file")
    p.add_argument("--plan", help="show a saved plan instead of planning")
    p.add_argument("--plot", help="write a PNG of the decisions and predicted memory")
    p.add_argument("--backend", default="auto", choices=("auto", "cpp", "python"), help="search core")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="the paper's experiment grid, predicted (throughput ratios vs FSDP)")
    _add_cluster_flag(p)
    _add_world_size_flag(p)
    p.add_argument("--backend", default="auto", choices=("auto", "cpp", "python"))
    p.add_argument("--quick", action="store_true", help="one model per family")
    g = p.add_argument_group("--scale: OSDP vs FSDP2 full shard, FSDP2 HSDP and ZeRO++ hpZ on multi-node clusters")
    g.add_argument("--scale", action="store_true",
                   help="Llama 7B/13B/70B on 16 to 1024 GPUs of each multi-node profile (osdp/cli/scale.py)")
    g.add_argument("--scale-clusters", help="comma-separated cluster profiles (default: the multi-node ones)")
    g.add_argument("--scale-models", help="comma-separated Llama presets (default llama2-7b,llama2-13b,llama2-70b)")
    g.add_argument("--scale-worlds", help="comma-separated GPU counts (default 16,64,256,1024)")
    g.add_argument("--seq", type=int, help="sequence length (default: the preset's, 4096)")
    g.add_argument("--out", help="write scale_<cluster>.txt and .svg into this folder (e.g. bench/results)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's Figure 5 cell by cell: our predicted ratios beside the paper's reported figures, "
                        "and why a cell differs by more than 10%%")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("demo", help="plan and train a small GPT on this machine (2 gloo processes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--memory", default="96MiB", help="memory limit per process with a unit, e.g. 96MiB")
    p.add_argument("--preset", default="small")
    p.add_argument("--reprofile", action="store_true",
                   help="measure this machine again instead of reading the profile cache (also: OSDP_REPROFILE=1); "
                        "the cache is $OSDP_CACHE_DIR/profile-cache.json, default ~/.cache/osdp/profile-cache.json")
    p.set_defaults(func=cmd_demo)
    return parser


def cmd_presets(args) -> int:
    from ..models import PRESETS

    for name, c in sorted(PRESETS.items()):
        widths = f" widths {','.join(map(str, c.block_hidden))}" if c.block_hidden else ""
        print(f"{name:18s} layers {c.num_layers:3d} hidden {c.hidden:6d} heads {c.heads:3d} seq {c.seq_len:5d} vocab {c.vocab_size}{widths}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def _attach_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--memory -1GiB`` -> ``--memory=-1GiB``: argparse takes a value that starts with
    ``-`` and is no number for the next option ("expected one argument"); attached, it
    reaches the option's own check, which says what is wrong with it."""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    flags = {opt: action for p in parsers for opt, action in p._option_string_actions.items()}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        action = flags.get(token)
        takes_value = action is not None and action.nargs is None and action.option_strings
        if takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in flags:
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_dash_values(list(sys.argv[1:] if argv is None else argv), parser))
    try:
        return args.func(args)
    except OSDPError as exc:
        print(f"osdp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("osdp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m osdp.cli.main
    sys.exit(main())
