"""The planner's memory promise on stock Hugging Face models (a causal LM with its key /
value cache in the output, an encoder-decoder with a tied small embedding), planned at the
least memory any plan needs and run on a fake 2-rank group with the per-step check on:
the output the loop holds ([Note: the held output]), the coalesced groups of small units,
tied ones included, whole ([Note: pending reduction]). Before, these models measured
4.8% (Llama) and 7.3% (Whisper) over their predictions in backward and stopped with
MemoryLimitExceeded at their second step."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

import osdp  # noqa: E402
from osdp.errors import InfeasiblePlanError  # noqa: E402
from osdp.planner import make_plan  # noqa: E402
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings  # noqa: E402
from osdp.planner.description import describe  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))


def _whisper():
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.0))


def _batch(kind: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "whisper":
        return {"input_features": torch.randn(2, 8, 16, generator=g),
                "labels": torch.randint(3, 100, (2, 6), generator=g)}
    x = torch.randint(3, 100, (2, 12), generator=g)
    return {"input_ids": x, "labels": x}


def _build(kind: str):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return _llama() if kind == "llama" else _whisper()


def test_describe_measures_what_the_output_holds_after_backward():
    """Llama's output keeps its logits and its key / value cache (use_cache, the config's
    default): counted by hand from their shapes."""
    model = _build("llama")
    batch = _batch("llama", 0)
    desc = describe(model, batch)
    out = model(**batch)
    cache = out.past_key_values
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert desc.output_bytes_per_sample * 2 == out.logits.numel() * out.logits.element_size() + kv
    model.config.use_cache = False
    assert describe(model, batch).output_bytes_per_sample * 2 == out.logits.numel() * out.logits.element_size()


@pytest.mark.parametrize("kind", ["llama", "whisper"])
@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_plan_at_the_least_memory_holds_its_measured_peak(fake_world, kind):
    desc = describe(_build(kind), _batch(kind, 0))
    cluster = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0)
    settings = PlannerSettings(coalesce_bytes=65536, optimizer_temporaries="per_tensor")

    def plan_at(limit):
        return make_plan(desc, cluster.for_run(RunSettings(world_size=fake_world, memory_limit_bytes=limit)),
                         settings, batch=2)

    with pytest.raises(InfeasiblePlanError) as refused:
        plan_at(100_000)
    plan = plan_at(int(refused.value.min_bytes * 1.01))
    model = osdp.OSDP(_build(kind), plan=plan, coalesce_bytes=65536)  # the check on, at the plan's limit
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):  # the first makes AdamW's state
        out = model(**_batch(kind, step))  # held through backward and the step, as priced
        out.loss.backward()
        optim.step()
        optim.zero_grad()
        del out
    measured = model.step_memory()
    assert measured.step == 2 and measured.peak_bytes <= plan.memory_limit_bytes
    assert -0.05 <= measured.prediction_error <= 0.0, (measured.peak_bytes, plan.predicted.peak_bytes, measured.where)
    print(f"\n{kind}: limit {plan.memory_limit_bytes:.0f} B, predicted {plan.predicted.peak_bytes:.0f} B at "
          f"{plan.predicted.peak_op}, measured {measured.peak_bytes} B {measured.where} "
          f"({measured.prediction_error:+.2%})")


@pytest.mark.parametrize("trained", ["everything", "the head"])
@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_the_loss_moment_is_priced_at_a_batch_beyond_the_described_ones(fake_world, trained):
    """[Note: the loss's moment]: a cross-entropy over a large vocabulary peaks in its own
    backward (four logits-sized tensors); described at batches 1 and 2, where the head's
    weight gradient (a constant) is larger, and planned at 8. Before, it was priced by one
    line through the head's larger moment: 15% under with only the head training."""
    from osdp.planner.uniform_plan import uniform_plan

    def build():
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, use_cache=False))
        for name, p in model.named_parameters():
            p.requires_grad_(trained == "everything" or name.startswith("lm_head"))
        return model

    def tokens(batch, seed):
        x = torch.randint(0, 2048, (batch, 32), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": x, "labels": x}

    desc = describe(build(), tokens(2, 0))
    device = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0).for_run(
        RunSettings(world_size=fake_world, memory_limit_bytes=1 << 30))
    # unsplit: a head split in 4 (1 zdp, 3 dp slices) measured 2 KiB (0.015%) over its
    # prediction with everything training, not found (closing note of stop 57)
    plan = uniform_plan(desc, device, PlannerSettings(optimizer_temporaries="per_tensor"), 8)
    model = osdp.OSDP(build(), plan=plan)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        with model.measuring_memory(optim) as measured:
            out = model(**tokens(8, step))
            out.loss.backward()
            optim.step()
            optim.zero_grad()
            del out
    error = measured[0].peak_bytes / plan.predicted.peak_bytes - 1
    assert -0.02 <= error <= 0.0, (measured[0].peak_bytes, plan.predicted.peak_bytes, measured[0].where)
