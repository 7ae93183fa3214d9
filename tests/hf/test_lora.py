"""LoRA fine-tuning (``peft.get_peft_model`` on a stock Llama, the base frozen) wrapped
by OSDP on 2 gloo ranks, eager and compiled, against single-process training of the same
adapters: the losses, the adapters as peft saves them (``get_peft_model_state_dict`` of
the unwrapped model over ``osdp.checkpoint.full_state_dict``; the unwrapped model's own
``save_pretrained`` would see this rank's pieces), the base unchanged."""
from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="LoRA tests need `pip install peft`")

import torch  # noqa: E402

from runtime.dist_harness import spawn  # noqa: E402

from . import lora_cases as lc  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    import peft

    model = lc.lora_llama()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    losses = lc.train(model, 2, None)
    return losses, peft.get_peft_model_state_dict(model), base


@pytest.mark.parametrize("compile_arg", [None, {"backend": "aot_eager"}], ids=["eager", "compiled"])
def test_lora_adapters_train_as_single_process(reference, compile_arg):
    ref_losses, ref_adapters, base = reference
    runs = spawn(lc.run_lora, 2, compile_arg)
    for run in runs:
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert run["trainable"] and all("lora_" in n for n in run["trainable"]), run["trainable"]
    adapters, full = runs[0]["adapters"], runs[0]["full"]
    assert sorted(adapters) == sorted(ref_adapters) and len(adapters) == 8
    for key, value in ref_adapters.items():
        torch.testing.assert_close(adapters[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    for key, value in base.items():
        assert torch.equal(full[key], value), f"{key}: the frozen base changed"


@pytest.mark.usefixtures("one_rank_group")
def test_lora_on_expert_parameters_is_refused_before_anything_changes():
    """peft's LoRA on a MoE's 3-D expert weights (``target_parameters``) swaps a
    parametrization in at every forward and reads its adapters' weights without calling
    their modules: it raised 'setStorage ... storage of size 0' inside the first forward."""
    import peft
    import transformers

    import osdp

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=16)
    model = peft.get_peft_model(transformers.MixtralForCausalLM(config), peft.LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for auto in ({}, {"memory_limit": "64MiB", "example_inputs": {"input_ids": torch.zeros(2, 4, dtype=torch.long)}}):
        with pytest.raises(osdp.OSDPError, match=r"'base_model.model.model.layers.0.mlp.experts' is peft's LoRA on "
                                                 r"the parameter 'gate_up_proj' .*target_modules"):
            osdp.OSDP(model, **auto)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_a_lora_plan_prices_the_frozen_base_without_gradients_or_optimizer_state():
    """[Note: frozen units]: the base's units are frozen, the adapters train, what runs
    before the first adapter has no backward; the plan's optimizer state is the
    adapters' alone (AdamW's two fp32 moments of every adapter element, over 2 ranks)."""
    from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
    from osdp.planner.cost_model import PlannerSettings, static_bytes
    from osdp.planner.description import describe
    from osdp.planner.run import RunSettings

    model = lc.lora_llama()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    desc = describe(model, {"input_ids": tokens, "labels": tokens})
    ops = {op.name.split("base_model.model.")[-1]: op for op in desc.ops}
    assert ops["model.embed_tokens"].trainable is ops["model.embed_tokens"].in_backward is False
    first = ops["model.layers.0.self_attn.q_proj.base_layer"]
    assert not first.trainable and not first.in_backward  # it runs before the first adapter
    later = ops["model.layers.1.self_attn.q_proj.base_layer"]
    assert not later.trainable and later.in_backward  # layer 0's adapters feed it
    assert ops["model.layers.0.self_attn.q_proj.lora_A.default"].trainable
    device = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=2, memory_limit_bytes=1 << 30))
    settings = PlannerSettings()
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    expected = sum(-(-p.numel() // 2) * settings.optimizer_state_bytes_per_param
                   + settings.optimizer_state_bytes_per_tensor for p in adapters)
    assert static_bytes(desc, device, settings)["optimizer_state"] == expected
