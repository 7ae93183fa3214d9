"""The experts of a stock Hugging Face mixture of experts split by groups of experts
([Note: experts split] in osdp/ops/split_experts.py), in one process (a 1-rank gloo
group): training against the plain model, a checkpoint read into the unsplit layout,
the peak it lowers, and the layouts and slice counts it refuses. Two ranks routing
their own tokens: test_other_models.py's split cases; Hugging Face checkpoints:
test_hf_checkpoint.py."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

import osdp  # noqa: E402
import osdp.checkpoint as ckpt  # noqa: E402
from osdp.errors import OSDPError  # noqa: E402

from . import other_models_cases as oc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_rank_group")
EXPERTS = "model.layers.{}.mlp.experts"


def _steps(model, kind="mixtral", steps=3):
    return oc.train(model, kind, 1, None)[:steps]


@pytest.mark.parametrize("kind,splits", [
    ("mixtral", {EXPERTS.format(0): 8, EXPERTS.format(1): 2}),
    ("deepseek_v3", {EXPERTS.format(1): 4, EXPERTS.format(2): 8}),
])
def test_split_experts_train_as_the_plain_model(kind, splits):
    name = next(iter(splits))
    model = osdp.OSDP(oc.build(kind), splits=splits, modes={f"{name}[1]": "dp", f"{name}[2]": "dp"})
    reference = oc.build(kind)
    assert oc.train(model, kind, 1, None) == pytest.approx(oc.train(reference, kind, 1, None), rel=1e-5)
    state = model.full_state_dict(rank0_only=False)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    # the original parameters, once each under their names: one tensor per rank over the slices
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_checkpoint_of_split_experts_loads_unsplit(tmp_path):
    split = osdp.OSDP(oc.build("mixtral"), splits={EXPERTS.format(0): 4})
    optim = torch.optim.AdamW(split.parameters(), lr=1e-2)
    for step in range(2):
        batch = oc._batch("mixtral", step, 1)
        split(**batch).loss.backward()
        optim.step()
        optim.zero_grad()
    ckpt.save(split, optim, str(tmp_path / "c"), step=2)
    whole = osdp.OSDP(oc.build("mixtral"))
    optim2 = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    ckpt.load(whole, optim2, str(tmp_path / "c"))
    for model, opt in ((split, optim), (whole, optim2)):  # one more step each: the optimizer states agree
        model(**oc._batch("mixtral", 2, 1)).loss.backward()
        opt.step()
    a, b = split.full_state_dict(rank0_only=False), whole.full_state_dict(rank0_only=False)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_split_experts_gather_less_at_the_peak():
    """zdp everywhere, no prefetch, experts the largest units: at an experts unit's
    backward, unsplit, its gathered weights and its unsharded gradient are both a layer's
    experts; split in 8 (4 groups of 2 experts), a slice of each. The step's measured
    peak drops by twice (a layer's experts - the largest slice)."""
    config = dict(hidden_size=32, intermediate_size=128, num_local_experts=8)
    peaks = {}
    for g in (1, 8):
        splits = {EXPERTS.format(i): g for i in range(2)} if g > 1 else {}
        # modes= given: not auto mode (a limit alone would plan)
        model = osdp.OSDP(oc.build("mixtral", **config), splits=splits, modes={"lm_head": "zdp"}, prefetch_bytes=0,
                          memory_limit="1GiB")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            model(**oc._batch("mixtral", step, 1)).loss.backward()
            optim.step()
            optim.zero_grad()
        model.end_step()
        peaks[g] = model.step_memory().peak_bytes
    experts_bytes = 8 * 3 * 32 * 128 * 4  # gate_up [8, 256, 32] and down [8, 32, 128], fp32
    largest_slice = 2 * 256 * 32 * 4  # gate_up of 2 experts
    assert peaks[1] - peaks[8] == pytest.approx(2 * (experts_bytes - largest_slice), rel=0.02), peaks


def test_bad_slice_counts_and_layouts_are_refused_before_the_model_changes():
    model = oc.build("mixtral")  # 4 experts: g = 2, 4 or 8
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for g, match in ((3, r"g = 2m slices .* one of \[2, 4, 8\]"), (6, r"one of \[2, 4, 8\]"),
                     (16, r"into 16 slices")):
        with pytest.raises(OSDPError, match=match):
            osdp.OSDP(model, splits={EXPERTS.format(0): g})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    layout = r"GptOssExperts.*has_bias=True, is_transposed=True, is_concatenated=False: leave it unsplit"
    with pytest.raises(OSDPError, match=layout):
        osdp.OSDP(oc.build("gpt_oss"), splits={EXPERTS.format(0): 2})


def test_inputs_are_cast_to_the_gathered_dtype():
    """bf16 gathers (mixed precision), an fp32 input: cast as transformers casts it to
    the weights' dtype, against the plain experts module in bf16."""
    from osdp.runtime.mixed_precision import MixedPrecision

    model = osdp.OSDP(oc.build("mixtral"), splits={EXPERTS.format(0): 4},
                      mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    plain = oc.build("mixtral").model.layers[0].mlp.experts.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=gen, requires_grad=True)
    index, weights = torch.randint(0, 4, (6, 2), generator=gen), torch.rand(6, 2, generator=gen)
    out = model.unwrapped.model.layers[0].mlp.experts(hidden, index, weights)
    out.sum().backward()
    assert out.dtype == hidden.grad.dtype == torch.float32
    want = plain(hidden.detach().to(torch.bfloat16), index, weights.to(torch.bfloat16))
    torch.testing.assert_close(out, want.float(), rtol=2e-2, atol=2e-2)
