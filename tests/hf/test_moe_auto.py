"""A stock Hugging Face mixture of experts (``MixtralForCausalLM``, experts as 3-D weights
run by a grouped matmul) built on the meta device and wrapped in auto mode: described
on fake tensors (the grouped matmul's meta kernel took bf16 only, [Note: grouped matmul]
in osdp/planner/grouped_mm.py; its FLOPs are tested in tests/planner/test_grouped_mm.py),
planned, made real shard by shard by the model's own ``_init_weights``, then trained as
single-process training of the same weights. One rank: the multi-rank parity of the model is in
test_other_models.py."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

import osdp  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_rank_group")

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
              output_router_logits=True, router_aux_loss_coef=0.02)
STEPS, SEQ = 3, 8


def _stock(device=None):
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device(device or "cpu"):
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))


def _tokens(step, batch):
    return torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(step))


def _train(model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses = []
    for step in range(STEPS):
        x = _tokens(step, batch)
        loss = model(input_ids=x, labels=x).loss  # the LM loss plus the router's load-balancing loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_meta_mixtral_in_auto_mode_trains_as_single_process(tmp_path):
    torch.manual_seed(0)
    meta = _stock("meta")
    x = _tokens(100, 2)
    wrapped = osdp.OSDP(meta, memory_limit="64MiB", example_inputs={"input_ids": x, "labels": x},
                        param_init_fn=meta._init_weights,
                        auto_kwargs={"cache_dir": str(tmp_path), "budget_s": 20, "progress": False})
    assert sum(u.name.endswith("mlp.experts") for u in wrapped.plan.units) == CONFIG["num_hidden_layers"]
    reference = _stock()
    reference.load_state_dict(wrapped.full_state_dict())  # the weights the meta build drew
    assert _train(wrapped, wrapped.batch_size) == pytest.approx(_train(reference, wrapped.batch_size), rel=1e-5)
    trained = wrapped.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_least_memory_plan_of_an_infeasible_mixtral_keeps_no_weights():
    """The infeasible-plan error's least-memory plan: per op, of options with equal kept
    plus transient bytes, the one that keeps least. The experts' dp option ties with zdp
    at their own moment, and was listed (kept_dp_weights 73728 B) though it is held at
    every op in between."""
    import osdp.planner as planner
    from osdp.errors import InfeasiblePlanError

    x = _tokens(0, 2)
    desc = planner.describe(_stock(), {"input_ids": x, "labels": x})
    device = planner.load_cluster("titan-rtx-pcie3").for_run(planner.RunSettings(world_size=2,
                                                                               memory_limit_bytes=2**20))
    with pytest.raises(InfeasiblePlanError) as info:
        planner.make_plan(desc, device, planner.PlannerSettings(checkpointing="auto"), batch=2)
    assert info.value.breakdown.get("kept_dp_weights", 0) == 0
