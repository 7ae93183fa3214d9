"""A model's buffers in the memory model: every rank holds them whole. Stock GPT-Neo
registers a causal mask per layer (``max_position_embeddings`` squared booleans); its
attention saves a view of it, which describe counted as a constant activation (so gone
at the optimizer step's moment). A buffer no op saves was not counted at all: a plan of
a model with a position table measured the table over its prediction."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

import osdp  # noqa: E402
from osdp.planner import make_plan  # noqa: E402
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings  # noqa: E402
from osdp.planner.description import describe  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402

POSITIONS, VOCAB, SEQ, BATCH = 512, 100, 8, 2


def _model(kind, device=None):
    if kind == "gpt_neo":
        config = transformers.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=POSITIONS, hidden_size=32,
                                           num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                           window_size=4, embed_dropout=0.0, attention_dropout=0.0,
                                           resid_dropout=0.0)
        build = transformers.GPTNeoForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4,
                                         embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
        build = _WithPositionTable
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return build(config)


class _WithPositionTable(transformers.GPT2LMHeadModel):
    """Stock GPT-2 with a fixed table added to its input embeddings (a sinusoidal
    position table, as models register one): a 1 MiB buffer read through a slice, which
    no operator saves."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("table", torch.randn(POSITIONS, 16, config.n_embd) / 16)

    def forward(self, input_ids, labels=None):
        embeds = self.transformer.wte(input_ids) + self.table[:input_ids.shape[1]].sum(1)
        return super().forward(inputs_embeds=embeds, labels=labels)


def _batch(seed):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _buffer_bytes(model) -> int:
    return sum(b.nbytes for b in model.buffers())


def test_describe_counts_the_buffers_once_real_or_on_meta():
    masks = 2 * POSITIONS * POSITIONS  # a bool per position pair, per layer
    real = describe(_model("gpt_neo"), _batch(0))
    on_meta = describe(_model("gpt_neo", "meta"), _batch(0))
    assert real.buffer_bytes == on_meta.buffer_bytes == _buffer_bytes(_model("gpt_neo")) >= masks
    assert real.act_constant_bytes < 1024  # the masks' slices its attention saves are the buffers, not activations


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("kind", ["gpt_neo", "table"])
def test_a_plan_of_a_model_with_large_buffers_measures_within_its_prediction(fake_world, kind):
    desc = describe(_model(kind), _batch(0))
    device = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0).for_run(
        RunSettings(world_size=fake_world, memory_limit_bytes=64 * 2**20))
    plan = make_plan(desc, device, PlannerSettings(policy="zdp", optimizer_temporaries="per_tensor"), batch=BATCH)
    wrapped = osdp.OSDP(_model(kind), plan=plan, memory_check=False)
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, foreach=False)
    for seed in range(3):  # the first step makes AdamW's state
        with wrapped.measuring_memory(optim) as measured:
            wrapped(**_batch(seed)).loss.backward()
            optim.step()
            optim.zero_grad()
    peak, predicted = measured[0].peak_bytes, plan.predicted.peak_bytes
    assert _buffer_bytes(wrapped) > 0.3 * predicted  # most of this tiny model
    assert 0.97 * predicted <= peak <= predicted, (peak, plan.predicted)
