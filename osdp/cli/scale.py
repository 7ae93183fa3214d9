"""``osdp simulate --scale``: OSDP's plan against the peers' fixed choices, predicted for
Llama-shaped models on multi-node clusters (issue 12).

For every multi-node cluster profile, model and GPU count, the predicted throughput
(samples/s and tokens/s per GPU) of

    OSDP          per unit and per slice dp / zdp / hpz, splits up to SCALE_MAX_SLICES,
                  checkpointing per block, the layout (full shard or HSDP) per plan
    FSDP2 full    every unit zdp over one shard group of all GPUs (fully_shard)
    FSDP2 HSDP    every unit zdp, sharded within a node, replicated across nodes
    ZeRO++ hpZ    every unit hpz (FSDP2 reshard_after_forward=node_size): forward gathers
                  over all GPUs, backward from a copy sharded within the node

each at its own best batch under the same memory (the whole device). The peers are not
measured: they are fixed-choice plans priced by the same cost model (the same two-level
collectives of collective_cost.py, the same per-op overlap, units = ops for all; FSDP2's
per-block wrapping, ZeRO++'s quantized weights and gradients (qwZ, qgZ) and NCCL's tree
all-reduce are not modelled). A peer takes the better of no checkpointing and
checkpointing every block. Mixed precision as torchtitan runs it: bf16 weights, fp32
gradient reduction, fp32 master weights and AdamW state. The plan re-ranking by the
step simulation is off (the exact search's objective is compared).

Per cell the report names each peer OSDP beats and the step-time component per sample
that differs most (compute, recompute of checkpointed blocks, communication not hidden
behind compute, optimizer), with the choices behind it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InfeasiblePlanError
from ..sizes import format_bytes
from ..planner.cluster import load_cluster
from ..planner.cost_model import PlannerSettings, option_times, option_compute_s, optimizer_step_s
from ..planner.llama_desc import describe_llama, llama_preset
from ..planner.run import RunSettings
from ..planner.batch_sweep import Scheduled, schedule

SCALE_PROFILES = ("h100-ib-ndr", "a100-ib-hdr", "pcie-100gbe")
SCALE_MODELS = ("llama2-7b", "llama2-13b", "llama2-70b")
SCALE_WORLDS = (16, 64, 256, 1024)
SCALE_MAX_SLICES = 2  # keeps the whole grid under a minute; the search stays exact
BASE = dict(param_dtype_bytes=2, reduce_dtype_bytes=4, rerank=False, max_slices=SCALE_MAX_SLICES)
OSDP = "OSDP"
PEERS = {
    "FSDP2 full": dict(policy="zdp", layout="full"),
    "FSDP2 HSDP": dict(policy="zdp", layout="hsdp"),
    "ZeRO++ hpZ": dict(policy="hpz", layout="full"),
}
PEER_CHECKPOINTING = ("auto",)
COMPONENTS = ("compute", "recompute", "exposed comm", "optimizer")


@dataclass(frozen=True)
class Run:
    """One system's best plan in one cell (None fields: nothing fits)."""

    system: str
    samples_per_s_per_gpu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    batch: int = 0
    layout: str = ""
    checkpointed_blocks: int = 0
    modes: dict = field(default_factory=dict)  # mode -> slices in it
    per_sample_s: dict = field(default_factory=dict)  # component -> seconds per sample


def step_components(s: Scheduled) -> dict[str, float]:
    """Seconds of one step by component ([Note: time model] in docs/design/cost_model.md): compute,
    the recompute of checkpointed blocks, the communication the per-op overlap leaves
    exposed, the optimizer."""
    t = s.template
    chosen = np.asarray(s.result.option_index, dtype=np.int64)
    comp_f, comp_b = option_compute_s(t, s.batch)
    steps = t.settings.accumulation_steps
    compute = steps * float(np.sum(comp_f[chosen] + comp_b[chosen]))
    recompute = steps * float(np.sum((comp_f * t.opt_checkpointed)[chosen]))
    total = float(np.sum(option_times(t, s.batch)[chosen]))
    return {"compute": compute, "recompute": recompute, "exposed comm": max(total - compute - recompute, 0.0),
            "optimizer": optimizer_step_s(t.desc, t.device, t.settings)}


def _run(system: str, s: Scheduled | None, seq: int) -> Run:
    if s is None:
        return Run(system)
    t = s.template
    world = t.device.world_size
    chosen = s.result.option_index
    modes = {"dp": 0, "zdp": 0, "hpz": 0, "rep": 0}
    for i, o in enumerate(chosen):
        if t.desc.ops[i].tied_to:
            continue
        if t.rep is not None and t.rep[i]:
            modes["rep"] += 1
            continue
        g, k, h = t.shape(o)
        modes["zdp"] += k
        modes["hpz"] += h
        modes["dp"] += g - k - h
    samples = s.batch * s.accumulation_steps
    per_gpu = s.samples_per_s / world
    return Run(system, per_gpu, per_gpu * seq, s.batch, t.settings.layout,
               sum(1 for seg, v in zip(t.segments, s.result.variant) if seg.variants[v]), modes,
               {k: v / samples for k, v in step_components(s).items()})


def _best(desc, device, options: list[dict], backend: str) -> Scheduled | None:
    best = None
    for overrides in options:
        try:
            s = schedule(desc, device, PlannerSettings(**BASE, **overrides), backend=backend)
        except InfeasiblePlanError:
            continue
        if best is None or s.samples_per_s > best.samples_per_s:
            best = s
    return best


def scale_cell(desc, device, seq: int, backend: str = "auto") -> dict[str, Run]:
    """OSDP and every peer in one cell, each at its own best batch."""
    runs = {OSDP: _run(OSDP, _best(desc, device, [dict(layout="auto", checkpointing="auto")], backend), seq)}
    for name, overrides in PEERS.items():
        options = [dict(overrides, checkpointing=c) for c in PEER_CHECKPOINTING]
        runs[name] = _run(name, _best(desc, device, options, backend), seq)
    return runs


def why(osdp: Run, peer: Run) -> str:
    """Which component of the step time per sample differs most, OSDP against ``peer``."""
    if osdp.samples_per_s_per_gpu is None:
        return "no OSDP plan fits"
    if peer.samples_per_s_per_gpu is None:
        return f"{peer.system} does not fit in memory at batch 1; OSDP fits ({_choices(osdp)})"
    ratio = osdp.samples_per_s_per_gpu / peer.samples_per_s_per_gpu
    diffs = {c: osdp.per_sample_s[c] - peer.per_sample_s[c] for c in COMPONENTS}
    total = sum(peer.per_sample_s.values())
    ranked = sorted(diffs, key=lambda c: -abs(diffs[c]))
    shown = [c for c in ranked if abs(diffs[c]) >= 0.005 * total] or ranked[:1]
    verb = "beats" if ratio > 1.0005 else ("ties" if ratio > 0.9995 else "trails")
    parts = ", ".join(f"{c} {diffs[c] * 1e3:+.1f}" for c in shown)
    return (f"{verb} {peer.system} {ratio:.3f}x; OSDP - peer, ms/sample: {parts} "
            f"(OSDP {_choices(osdp)}; {peer.system} {_choices(peer)})")


def _choices(r: Run) -> str:
    modes = "/".join(f"{r.modes[m]} {m}" for m in ("dp", "zdp", "hpz", "rep") if r.modes.get(m))
    return f"batch {r.batch}, {r.layout}, {modes}, {r.checkpointed_blocks} ckpt blocks"


def simulate_scale(profiles=SCALE_PROFILES, models=SCALE_MODELS, worlds=SCALE_WORLDS, backend: str = "auto",
                   seq_len: int | None = None) -> list[tuple]:
    """Rows (profile, model, world size, {system: Run})."""
    rows = []
    descs = {m: (describe_llama(llama_preset(m, seq_len), name=m), llama_preset(m, seq_len).seq_len) for m in models}
    for profile in profiles:
        cluster = load_cluster(profile)
        for model in models:
            desc, seq = descs[model]
            for world in worlds:
                device = cluster.for_run(RunSettings(world_size=world))
                rows.append((profile, model, world, scale_cell(desc, device, seq, backend)))
    return rows


def _cell(r: Run, osdp: Run | None = None) -> str:
    if r.samples_per_s_per_gpu is None:
        return "OOM"
    text = f"{r.samples_per_s_per_gpu:.3f} {r.tokens_per_s_per_gpu:,.0f}"
    if osdp is not None and osdp.samples_per_s_per_gpu is not None:
        text += f" ({osdp.samples_per_s_per_gpu / r.samples_per_s_per_gpu:.2f}x)"
    return text


def format_scale(rows, profile: str) -> str:
    cluster = load_cluster(profile)
    systems = (OSDP,) + tuple(PEERS)
    widths = {OSDP: 22, **{p: 28 for p in PEERS}}
    head = f"{'model':<11} {'GPUs':>5}  " + "  ".join(f"{s:>{widths[s]}}" for s in systems)
    lines = [f"osdp simulate --scale: {cluster.name} ({profile}), {format_bytes(cluster.device_memory_bytes)} per GPU",
             "predicted samples/s per GPU and tokens/s per GPU; (x): OSDP / peer. Peers are fixed-choice plans "
             "priced by the same cost model (osdp/cli/scale.py says what is and is not modelled).",
             head, "-" * len(head)]
    notes = []
    for prof, model, world, runs in rows:
        if prof != profile:
            continue
        o = runs[OSDP]
        lines.append(f"{model:<11} {world:>5}  " + "  ".join(
            f"{_cell(runs[s], None if s == OSDP else o):>{widths[s]}}" for s in systems))
        notes.append(f"{model} x {world}: OSDP {_choices(o)}" if o.samples_per_s_per_gpu else f"{model} x {world}: OOM")
        notes.extend(f"    {why(o, runs[p])}" for p in PEERS)
    lines.append("OOM: nothing fits at batch 1 in the device's memory.")
    lines.append("")
    lines.append("why, per cell: the components of the step time per sample that differ (OSDP minus the peer, "
                 "largest first; those under 0.5% of the peer's step left out) and the choices behind them: compute "
                 "(forward + backward), recompute (of checkpointed blocks), exposed comm (collectives the per-op "
                 "overlap does not hide), optimizer.")
    return "\n".join(lines + notes)


def plot_scale_svg(rows, profile: str, path) -> None:
    """Tokens/s per GPU against GPUs (log2), one panel per model, one line per system,
    as a plain SVG (no plotting library needed)."""
    models = list(dict.fromkeys(m for p, m, _, _ in rows if p == profile))
    systems = (OSDP,) + tuple(PEERS)
    colours = {OSDP: "#d7301f", "FSDP2 full": "#2b8cbe", "FSDP2 HSDP": "#31a354", "ZeRO++ hpZ": "#756bb1"}
    pw, ph, ml, mt, mb = 300, 220, 60, 40, 40
    width, height = ml + len(models) * (pw + 30), mt + ph + mb + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{ml}" y="18" font-size="13">{load_cluster(profile).name}: predicted tokens/s per GPU</text>']
    for j, model in enumerate(models):
        cells = [(w, runs) for p, m, w, runs in rows if p == profile and m == model]
        worlds = [w for w, _ in cells]
        values = [r.tokens_per_s_per_gpu for _, runs in cells for r in runs.values() if r.tokens_per_s_per_gpu]
        top = max(values, default=1.0) * 1.1
        x0 = ml + j * (pw + 30)
        lo, hi = math.log2(min(worlds)), math.log2(max(worlds))
        xs = lambda w: x0 + (0 if hi == lo else (math.log2(w) - lo) / (hi - lo) * pw)  # noqa: E731
        ys = lambda v: mt + ph - v / top * ph  # noqa: E731
        out.append(f'<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{x0 + pw / 2}" y="{mt - 6}" text-anchor="middle">{model}</text>')
        for w in worlds:
            out.append(f'<text x="{xs(w):.1f}" y="{mt + ph + 14}" text-anchor="middle">{w}</text>')
        for f in (0.0, 0.5, 1.0):
            out.append(f'<text x="{x0 - 4}" y="{ys(f * top) + 4:.1f}" text-anchor="end">{f * top:,.0f}</text>')
        out.append(f'<text x="{x0 + pw / 2}" y="{mt + ph + 28}" text-anchor="middle">GPUs</text>')
        for s in systems:
            pts = [(xs(w), ys(runs[s].tokens_per_s_per_gpu)) for w, runs in cells if runs[s].tokens_per_s_per_gpu]
            if pts:
                dash = "" if s == OSDP else ' stroke-dasharray="4 2"'
                out.append(f'<polyline fill="none" stroke="{colours[s]}" stroke-width="2"{dash} points="'
                           + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
                out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colours[s]}"/>' for x, y in pts)
    for i, s in enumerate(systems):
        x = ml + i * 130
        out.append(f'<line x1="{x}" y1="{height - 10}" x2="{x + 20}" y2="{height - 10}" stroke="{colours[s]}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{x + 24}" y="{height - 6}">{s}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")


def run_scale(out_dir=None, profiles=SCALE_PROFILES, models=SCALE_MODELS, worlds=SCALE_WORLDS,
              backend: str = "auto", seq_len: int | None = None) -> str:
    """The tables of every profile (and, with ``out_dir``, scale_<profile>.txt and .svg there)."""
    started = time.perf_counter()
    rows = simulate_scale(profiles, models, worlds, backend, seq_len)
    texts = []
    for profile in profiles:
        text = format_scale(rows, profile)
        texts.append(text)
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, f"scale_{profile}.txt").write_text(text + "\n")
            plot_scale_svg(rows, profile, Path(out_dir, f"scale_{profile}.svg"))
    return "\n\n".join(texts) + f"\n\n({len(rows)} cells in {time.perf_counter() - started:.1f} s)"
