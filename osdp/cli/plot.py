"""``osdp plan --plot``: per-unit decisions along the model and predicted memory over a step."""
from __future__ import annotations

from ..errors import OSDPError
from ..planner.cost_model import PlannerSettings, build_template, live_memory
from ..planner.plan import Plan
from ..sizes import byte_unit


def plan_assignment(plan: Plan, template):
    """Option index per op and variant per segment of ``template`` for ``plan``."""
    decided = {u.name: u for u in plan.units}
    ckpt = set(plan.checkpoint_blocks)
    variant = []
    for seg in template.segments:
        want = seg.name in ckpt
        if want not in seg.variants:
            raise OSDPError(f"plan checkpoints {seg.name!r} differently from what its settings allow")
        variant.append(seg.variants.index(want))
    seg_of = {i: s for s, seg in enumerate(template.segments) for i in seg.ops}
    options = []
    for i, op in enumerate(template.desc.ops):
        v = variant[seg_of[i]]
        owner = decided.get(op.name)
        g, k, h = (owner.slices, owner.zdp_slices, owner.hpz_slices) if owner else (1, 1, 0)
        match = [o for o in range(template.opt_begin[i, v], template.opt_end[i, v])
                 if template.opt_slices[o] == g
                 and (op.tied_to or (template.opt_zdp[o] == k and template.opt_hpz[o] == h))]
        if not match:
            raise OSDPError(f"unit {op.name!r}: {g} slices / {k} zdp is not an option under the plan's settings")
        options.append(match[0])
    return options, variant


def plot_plan(plan: Plan, path, desc=None, device=None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OSDPError("--plot needs matplotlib: pip install matplotlib") from None

    fig, axes = plt.subplots(2 if desc is not None else 1, 1, figsize=(12, 7 if desc is not None else 3.5), squeeze=False)
    ax = axes[0][0]
    names = [u.name for u in plan.units]
    zdp = [u.zdp_slices / u.slices for u in plan.units]
    rep = [1.0 if u.replicated else 0.0 for u in plan.units]
    dp = [1 - z - r for z, r in zip(zdp, rep)]
    x = range(len(names))
    ax.bar(x, dp, color="#2b8cbe", label="dp share of slices")
    ax.bar(x, zdp, bottom=dp, color="#f03b20", label="zdp share of slices")
    if any(rep):
        ax.bar(x, rep, color="#31a354", label="rep (replicated unit)")
    for i, u in enumerate(plan.units):
        if u.slices > 1:
            ax.text(i, 1.02, str(u.slices), ha="center", fontsize=6)
        if u.checkpointed:
            ax.plot(i, -0.06, marker="^", color="k", markersize=3)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylim(-0.1, 1.12)
    ax.set_ylabel("decision")
    ax.set_title(f"{plan.model_name}: per-unit modes (numbers: slices; ^: checkpointed), batch {plan.batch_size}")
    step = max(1, len(names) // 30)
    ax.set_xticks(list(x)[::step])
    ax.set_xticklabels(names[::step], rotation=90, fontsize=6)
    ax.legend(loc="lower right", fontsize=7)

    if desc is not None:
        settings = PlannerSettings(**plan.settings)
        template = build_template(desc, device, settings)
        options, variant = plan_assignment(plan, template)
        rows = live_memory(template, plan.batch_size, options, variant)
        fwd = [sum(v for k, v in live.items() if k not in ("activation_grads",)) for _, live in rows]
        bwd = [sum(live.values()) for _, live in rows]
        steps = list(range(len(rows))) + list(range(len(rows), 2 * len(rows)))
        curve = fwd + bwd[::-1]
        ax2 = axes[1][0]
        unit, scale = byte_unit(max(plan.memory_limit_bytes, max(curve, default=0.0)))
        ax2.plot(steps, [c / scale for c in curve], color="#636363")
        ax2.axhline(plan.memory_limit_bytes / scale, color="r", linestyle="--", label="limit")
        ax2.axvline(len(rows) - 0.5, color="k", linewidth=0.5)
        ax2.set_xlabel("op (forward, then backward in reverse)")
        ax2.set_ylabel(f"predicted live {unit}")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
