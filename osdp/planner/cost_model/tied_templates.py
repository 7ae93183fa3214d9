"""Tied units in the search: a template cut into sub-templates, one per joint choice of
the tied units' (slices, zdp), and a plan's tied uses aligned on one choice
(docs/design/cost_model.md's [Note: tied weights])."""
from __future__ import annotations

import itertools

import numpy as np

from ...errors import OSDPError
from .template import _COST_FIELDS, ProblemTemplate, restrict_template
from .units import tied_groups


def _varies_with_k(t: ProblemTemplate, i: int, g: int) -> bool:
    """Whether op ``i``'s options at ``g`` slices cost differently for different k."""
    for v in range(2):
        rows = [o for o in range(t.opt_begin[i, v], t.opt_end[i, v]) if t.opt_slices[o] == g]
        if len({tuple(float(getattr(t, name)[o]) for name in _COST_FIELDS) for o in rows}) > 1:
            return True
    return False


def tied_choices(t: ProblemTemplate) -> list[ProblemTemplate]:
    """[Note: tied weights] The search decides per op; a tied unit's uses must share one
    (g, k). So the template is cut into sub-templates, one per joint choice of the tied
    units' keys, each searched exactly and the best kept (scheduler.schedule): per tied
    unit and g, one sub-template when at most one of its uses costs differently with k
    (that use keeps its k free, the others follow it: ``align_tied``), else one per
    (g, k). A GPT's tied pair: the embedding's cost at g > 1 does not depend on k (its
    backward reads no weights), so it is one sub-template per g (plus one per k unsplit).
    Without tied units: ``[t]``."""
    groups = tied_groups(t.desc)
    if not groups:
        return [t]
    per_group = []
    for group in groups:
        member = np.isin(t.opt_op, group)
        keys = []
        for g in sorted({int(x) for x in t.opt_slices[member]}):
            varying = [i for i in group if _varies_with_k(t, i, g)]
            if len(varying) <= 1:
                keys.append((g, None, varying[0] if varying else group[-1]))
            else:
                keys.extend((g, k, None) for k in sorted({int(x) for x in t.opt_zdp[member & (t.opt_slices == g)]}))
        per_group.append(keys)
    result = []
    for combo in itertools.product(*per_group):
        keep = np.ones(len(t.opt_op), dtype=bool)
        for group, (g, k, _) in zip(groups, combo):
            ok = t.opt_slices == g
            if k is not None:
                ok &= t.opt_zdp == k
            keep &= ~np.isin(t.opt_op, group) | ok
        sub = restrict_template(t, keep)
        sub.tied_free = {group: free for group, (_, _, free) in zip(groups, combo) if free is not None}
        result.append(sub)
    return result


def align_tied(t: ProblemTemplate, option_index, variant) -> tuple[int, ...]:
    """``option_index`` with every use of a tied unit on the (g, k) of the use that chose
    freely in ``t`` (``tied_choices``); the others cost the same for every k, so time and
    memory are unchanged."""
    free = getattr(t, "tied_free", None)
    if not free:
        return tuple(option_index)
    seg_of = {i: s for s, seg in enumerate(t.segments) for i in seg.ops}
    chosen = list(option_index)
    for group, j in free.items():
        g, k = int(t.opt_slices[chosen[j]]), int(t.opt_zdp[chosen[j]])
        for i in group:
            v = int(variant[seg_of[i]])
            rows = [o for o in range(t.opt_begin[i, v], t.opt_end[i, v])
                    if t.opt_slices[o] == g and t.opt_zdp[o] == k]
            if not rows:
                raise OSDPError(f"tied unit {t.desc.ops[group[0]].name!r}: use {t.desc.ops[i].name!r} has no option "
                                f"with {g} slices, {k} zdp")
            chosen[i] = rows[0]
    return tuple(chosen)
