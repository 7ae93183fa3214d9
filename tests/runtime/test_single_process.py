"""In-process checks on a 1-rank gloo group: configuration errors, split ops against
the modules they replace, the registry, eval mode and the plan object."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn

import osdp
from osdp.contract import RuntimeConfig
from osdp.errors import OSDPError, PlanMismatchError
from osdp.models import GPT, GPTConfig, example_batch
from osdp.ops import SplitModule, get_split_op, register_split_op, split_sizes, unregister_split_op
from osdp.ops import kernels


CFG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def FakePlan(modes, world_size=1, prefetch_bytes=4096, checkpoint_blocks=(), fingerprint="fake", **kw):
    """A plan made by hand: the typed RuntimeConfig the runtime executes (a Plan's
    ``runtime_config()``), with only what a test needs."""
    return RuntimeConfig(unit_modes=dict(modes), world_size=world_size, prefetch_bytes=prefetch_bytes,
                         checkpoint_blocks=tuple(checkpoint_blocks), fingerprint=fingerprint, **kw)


def gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG.__dict__, **kw}))


# ---- configuration errors -----------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"modes": {"blocks.0.mlp.cfc": "dp"}}, r"'blocks.0.mlp.cfc' is not a unit.*did you mean 'blocks.0.mlp.c_fc'"),
        ({"modes": {"blocks.0.mlp": "dp"}}, r"owns no parameters itself.*blocks.0.mlp.c_fc"),
        ({"splits": {"nope": 2}}, r"splits: 'nope' is not a unit"),
        ({"modes": {"wte": "ddp"}}, r"modes\['wte'\]: mode 'ddp' is not one of 'dp', 'zdp'"),
        ({"default_mode": "fsdp"}, r"default_mode: mode 'fsdp'"),
        ({"modes": {"wte": []}}, r"non-empty sequence"),
        ({"modes": {"blocks.0.mlp.c_fc": ("dp", "zdp", "dp")}, "splits": {"blocks.0.mlp.c_fc": 2}}, r"3 per-slice modes but splits.* = 2"),
        ({"splits": {"blocks.0.mlp.c_fc": 0}}, r"integer >= 1"),
        ({"splits": {"blocks.0.mlp.c_fc": 11}}, r"in_features=10\) into 11 slices: use 1 <= g <= 10"),
        ({"splits": {"blocks.0.ln_1": 2}}, r"LayerNorm, which has no split op; modules that can be split: (Conv1D, )?Embedding, Linear"),
        ({"modes": {"blocks.0.mlp.c_fc[1]": "dp"}}, r"names slice 1 of 'blocks.0.mlp.c_fc', which is not split"),
        ({"modes": {"blocks.0.mlp.c_fc[5]": "dp"}, "splits": {"blocks.0.mlp.c_fc": 2}}, r"has 2 slices \(0..1\)"),
        ({"checkpoint_blocks": ("blocks.9",)}, r"checkpoint block 'blocks.9' is not a module path"),
        ({"prefetch_bytes": -1}, r"prefetch_bytes must be an integer >= 0"),
    ],
)
def test_bad_configs_raise_clear_errors(kwargs, match):
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSDPError, match=match):
        osdp.OSDP(model, **kwargs)
    # refused before anything changed (a slice count was checked after the units
    # before it were built, which had taken their parameters out of the model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())


class _TiedHeadWithBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 8)
        self.lm_head = nn.Linear(8, 50)  # owns a bias besides the shared weight
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.wte(idx))


class _HeadFirst(nn.Module):
    """As XLM-RoBERTa's masked LM: the head, registered before the embeddings, owns the
    bias its decoder adds, and the decoder's weight is the word embedding's."""

    def __init__(self):
        super().__init__()
        self.head = nn.Module()
        self.head.bias = nn.Parameter(torch.zeros(50))
        self.head.decoder = nn.Linear(8, 50)
        self.head.decoder.bias = self.head.bias
        self.wte = nn.Embedding(50, 8)
        self.wte.weight = self.head.decoder.weight

    def forward(self, idx):
        return self.head.decoder(self.wte(idx))


def test_a_subclass_of_a_splittable_module_is_refused_with_why():
    """Split ops go by exact type: a subclass's own forward (a scaled embedding, as stock
    Gemma's and BART's) would not run in its base's op."""
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    with pytest.raises(OSDPError, match=r"unit 'emb' is a Scaled, which has no split op \(a subclass of Embedding, "
                                        r"whose split op would not run its own forward: register an op"):
        osdp.OSDP(nn.Sequential(collections.OrderedDict(emb=Scaled(10, 4))), splits={"emb": 2})


def test_tied_splits_that_cannot_work_are_refused():
    # see [Note: tied row split]: only a module computing with nothing but the shared
    # weight can follow the split
    with pytest.raises(OSDPError, match=r"cannot split 'wte': its parameter 'wte.weight' is also 'lm_head.weight', "
                                        r"and 'lm_head' owns other parameters"):
        osdp.OSDP(_TiedHeadWithBias(), splits={"wte": 2})
    # a split of the decoder, or of the embedding tied to it, named the head to split,
    # which has no split op (found by a helper on stock XLM-RoBERTa)
    for named in ("head.decoder", "wte"):
        with pytest.raises(OSDPError, match=r"cannot split 'head.decoder' \(nor 'wte', which computes with its "
                                            r"weight\): its parameter 'head.bias' belongs to 'head'.*leave it unsplit"):
            osdp.OSDP(_HeadFirst(), splits={named: 2})
    # one weight, one slicing: the pair split two ways
    with pytest.raises(OSDPError, match=r"splits\['lm_head'\] = 3 but splits\['wte'\] = 2: 'lm_head' is a tied use of 'wte'"):
        osdp.OSDP(gpt(tie_embeddings=True), splits={"wte": 2, "lm_head": 3})
    # a tied use op that cuts the shared weight along another axis
    with pytest.raises(OSDPError, match=r"'linear_in_features' of 'lm_head' cuts slice 0 of the shared weight otherwise "
                                        r"than 'embedding_rows' of 'wte'"):
        osdp.OSDP(gpt(tie_embeddings=True), splits={"wte": 2}, split_ops={"lm_head": "linear_in_features"})
    # a plan whose tied uses are not this model's
    with pytest.raises(PlanMismatchError, match=r"the plan says 'lm_head' is a tied use of 'wte', but in this model "
                                                r"'lm_head' shares no weight"):
        osdp.OSDP(gpt(), plan=FakePlan({}, tied_uses={"lm_head": "wte"}))


def test_mixed_frozen_unit_is_refused():
    model = gpt()
    model.blocks[0].ln_1.bias.requires_grad_(False)
    with pytest.raises(OSDPError, match=r"'blocks.0.ln_1' mixes frozen and trainable"):
        osdp.OSDP(model)


def test_plan_world_size_mismatch():
    with pytest.raises(PlanMismatchError, match=r"made for world size 4, the process group has 1 ranks: plan again for 1"):
        osdp.OSDP(gpt(), plan=FakePlan({}, world_size=4))


def test_plan_and_modes_are_exclusive():
    with pytest.raises(OSDPError, match="either plan= or modes="):
        osdp.OSDP(gpt(), plan=FakePlan({}), modes={"wte": "dp"})


def test_auto_mode_needs_example_inputs():
    with pytest.raises(OSDPError, match="auto mode needs example_inputs"):
        osdp.OSDP(gpt(), memory_limit="1GiB")


# ---- the plan object --------------------------------------------------------------
def test_a_runtime_config_made_by_hand_is_a_plan():
    plan = FakePlan(
        {"wte": ("zdp",), "blocks.0.mlp.c_fc": ("dp", "zdp", "dp"), "lm_head": ("dp",), "blocks.1.mlp.c_fc": ("zdp",)},
        prefetch_bytes=1234,
        checkpoint_blocks=("blocks.1",),
    )
    model = osdp.OSDP(gpt(), plan=plan, default_mode="dp")
    modes = model.unit_modes()
    assert modes["wte"] == "zdp" and modes["lm_head"] == "dp" and modes["blocks.0.ln_1"] == "dp"
    assert [modes[f"blocks.0.mlp.c_fc[{i}]"] for i in range(3)] == ["dp", "zdp", "dp"]
    assert model.prefetch_bytes == 1234 and model.checkpoint_blocks == ("blocks.1",)
    assert model.plan_fingerprint == "fake"
    loss = model(*example_batch(CFG, 2))
    loss.backward()
    gathers = model.memory_stats()["all_gathers"]
    # checkpointed block: a zdp unit is gathered for forward, recompute and backward (the
    # 1234-byte window is too small to prefetch it); a dp unit once, kept throughout
    assert gathers["blocks.1.mlp.c_fc"] == 3 and gathers["blocks.1.mlp.c_proj"] == 1


def test_tied_alias_accepts_a_mode_and_shares_the_unit():
    # the alias's mode is the shared unit's (the two given different modes are refused:
    # tests/runtime/test_tied_split_single.py)
    model = osdp.OSDP(gpt(tie_embeddings=True), modes={"lm_head": "dp"}, default_mode="zdp")
    assert model.unit_modes()["wte"] == "dp"
    assert "lm_head" not in model.unit_names()
    assert model.tied_modules() == {"lm_head": "wte"}
    state = model.full_state_dict()
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])


# ---- split ops against the modules they replace ------------------------------------
@pytest.mark.parametrize("in_features,g", [(10, 4), (12, 3), (7, 7), (16, 1)])
@pytest.mark.parametrize("modes", ["dp", "zdp", "mixed"])
def test_split_linear_matches_linear(in_features, g, modes):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(in_features, 6))
    wrapped = nn.Sequential(nn.Linear(in_features, 6))
    wrapped.load_state_dict(ref.state_dict())
    slice_modes = ["dp", "zdp"] * g if modes == "mixed" else [modes] * g
    model = osdp.OSDP(wrapped, modes={"0": tuple(slice_modes[:g])}, splits={"0": g}, prefetch_bytes=0)
    x = torch.randn(2, 3, in_features, dtype=torch.float64).float().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    for _ in range(2):  # twice: gradients accumulate into .grad
        model(x).sin().sum().backward()
        ref(x_ref).sin().sum().backward()
    state = model.full_state_dict()
    torch.testing.assert_close(model(x), ref(x_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    assert list(grads) == ["0.weight", "0.bias"]  # one parameter each, by its original name
    assert torch.equal(state["0.weight"], ref[0].weight.detach())
    sizes = split_sizes(in_features, g)
    expected, k0 = [], 0
    for ks in sizes:  # one rank holds every slice's box W[:, k0:k0+ks], slice after slice
        expected.append(ref[0].weight.grad[:, k0 : k0 + ks].reshape(-1))
        k0 += ks
    torch.testing.assert_close(grads["0.weight"].reshape(-1), torch.cat(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["0.bias"], ref[0].bias.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", ["in_features", "out_features"])
def test_split_linear_under_autocast_computes_as_linear_does(axis):
    """Under the user's ``torch.autocast``, nn.Linear computes and returns in autocast's
    dtype; the split op returned fp32 (its in-place kernels are not autocast's), so the
    next layer ran in fp32 too. Values within bf16 rounding (the split adds its slices
    in fp32), dX in x's dtype as autocast's cast gives it."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 5))
    wrapped = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 5))
    wrapped.load_state_dict(ref.state_dict())
    model = osdp.OSDP(wrapped, splits={"0": 2}, split_ops={"0": "linear_" + axis} if axis == "out_features" else None)
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    seen = {}
    for net, tag in ((model.module, "split"), (ref, "ref")):
        net[0].register_forward_hook(lambda m, a, out, tag=tag: seen.update({tag: out.dtype}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = model(x), ref(x_ref)
    assert seen == {"split": torch.bfloat16, "ref": torch.bfloat16} and out.dtype == out_ref.dtype
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-2, atol=2e-2)


def test_split_embedding_matches_embedding_with_padding_idx():
    torch.manual_seed(0)
    ref = nn.Embedding(11, 4, padding_idx=3)
    wrapped = nn.Embedding(11, 4, padding_idx=3)
    wrapped.load_state_dict(ref.state_dict())
    model = osdp.OSDP(nn.Sequential(wrapped), modes={"0": ("zdp", "dp", "zdp")})
    idx = torch.tensor([[0, 3, 10, 5], [5, 5, 9, 1]])
    weights = torch.randn(2, 4, 4)
    (model(idx) * weights).sum().backward()
    (ref(idx) * weights).sum().backward()
    torch.testing.assert_close(model(idx), ref(idx))
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).view(11, 4)
    torch.testing.assert_close(grads, ref.weight.grad)
    assert model.memory_stats()["all_gathers"] == {"0[0]": 2, "0[1]": 2, "0[2]": 2}  # 2 forwards, no backward gather


def test_reference_slice_kernels():
    torch.manual_seed(0)
    x, w, dy = torch.randn(5, 9), torch.randn(4, 3), torch.randn(5, 4)
    out = torch.zeros(5, 4)
    kernels.addmm_slice_(out, x, w, 2, bias=torch.ones(4))
    torch.testing.assert_close(out, x[:, 2:5] @ w.T + 1)
    dx = torch.zeros(5, 9)
    kernels.slice_dx(dy, w, dx, 6)
    torch.testing.assert_close(dx[:, 6:9], dy @ w)
    assert dx[:, :6].abs().sum() == 0
    dw = torch.ones(4, 3)
    kernels.slice_dw(dy, x, 1, 3, out=dw, accumulate=True)
    torch.testing.assert_close(dw, 1 + dy.T @ x[:, 1:4])
    # bf16 input, fp32 accumulator: one cast at the end
    out = torch.zeros(5, 4)
    kernels.addmm_slice_(out, x.bfloat16(), w.bfloat16(), 2)
    torch.testing.assert_close(out, (x[:, 2:5] @ w.T), rtol=2e-2, atol=2e-2)


def test_reference_slice_dx_writes_its_block_with_no_temporary():
    """dX's column block is written by the GEMM itself: a (M, ks) temporary would be one
    slice of dX more at the peak of a K-split op's backward than the memory model counts."""
    from osdp.memtrack import StepPeakTracker

    torch.manual_seed(0)
    dy, w = torch.randn(64, 16, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    dx = torch.zeros(64, 96, dtype=torch.float64)
    with StepPeakTracker() as tracker:
        tracker.track([dy, w, dx])
        before = tracker.current_bytes
        kernels.ref_slice_dx(dy, w, dx, 32)
    assert tracker.peak_bytes == before  # no new storage
    torch.testing.assert_close(dx[:, 32:64], dy @ w, rtol=0, atol=1e-12)
    assert dx[:, :32].abs().sum() == 0 and dx[:, 64:].abs().sum() == 0
    # another output dtype still goes through one cast copy
    dx32 = torch.zeros(64, 96, dtype=torch.float32)
    kernels.ref_slice_dx(dy, w, dx32, 0)
    torch.testing.assert_close(dx32[:, :32], (dy @ w).float())


def test_registry_extension_point():
    class Bilinear3(SplitModule):  # a made-up op: only registration is exercised
        module_type = nn.Bilinear
        op_name = "bilinear_test"
        axis = "in_features"

    try:
        register_split_op(Bilinear3)
        assert get_split_op(nn.Bilinear(2, 2, 2)) is Bilinear3

        class Other(SplitModule):
            module_type = nn.Bilinear
            op_name = "other"
            axis = "out_features"

        with pytest.raises(OSDPError, match="already has default split op 'bilinear_test'"):
            register_split_op(Other)

        class Same(SplitModule):
            module_type = nn.Bilinear
            op_name = "bilinear_test"

        with pytest.raises(OSDPError, match="split op named 'bilinear_test' is already registered"):
            register_split_op(Same)
        Other.default_for_type = False  # a second op for the type, chosen by name
        register_split_op(Other)
        assert get_split_op(nn.Bilinear(2, 2, 2)) is Bilinear3
        assert get_split_op(nn.Bilinear(2, 2, 2), op_name="other") is Other
        with pytest.raises(OSDPError, match="splits Bilinear"):
            get_split_op(nn.Linear(2, 2), "x", op_name="other")
    finally:
        unregister_split_op("bilinear_test")
        unregister_split_op("other")
    with pytest.raises(TypeError):
        register_split_op(nn.Linear)


# ---- runtime behaviour --------------------------------------------------------------
def test_eval_forward_frees_everything_and_state_is_inspectable():
    model = osdp.OSDP(gpt(), default_mode="dp", splits={"blocks.0.mlp.c_fc": 2})
    with torch.no_grad():
        model(example_batch(CFG, 2)[0])
    assert model.gathered_units() == []
    stats = model.memory_stats()
    for key in ("peak_gathered_bytes", "peak_grad_bytes", "current_gathered_bytes", "unit_peak_gathered_bytes"):
        assert key in stats
    assert stats["current_gathered_bytes"] == 0 and stats["peak_gathered_bytes"] > 0
    model.reset_memory_stats()
    assert model.memory_stats()["peak_gathered_bytes"] == 0
    assert model.unwrapped is model.module
    assert "blocks.0.mlp.c_fc[1]" in model.unit_names()
    # the optimizer sees the original parameters by name, in order, each once: this
    # rank's piece (world size 1: all of it), with the original ndim; the split weight
    # too, one piece over its two slices
    plain = dict(gpt().named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(plain)
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.dim() == plain[name].dim(), name
        assert p.numel() == plain[name].numel(), name


def test_weights_updated_between_forwards_are_regathered():
    model = osdp.OSDP(gpt(), default_mode="dp")
    idx, tgt = example_batch(CFG, 2)
    with torch.no_grad():
        before = model(idx, tgt).item()
        for p in model.parameters():
            p.add_(0.05)
        after = model(idx, tgt).item()
    assert before != after


# ---- plan checks, mixed precision, accumulation API ------------------------------------
def _plan_for(model, settings=None, batch_size=2, **kw):
    """A config that priced every unit of ``model`` at 4-byte parameters."""
    from osdp.runtime.config import own_param_counts

    priced = {n: c * 4 for n, c in own_param_counts(model).items()}
    settings = settings or {}
    return FakePlan({n: ("zdp",) for n in priced}, unit_param_bytes=priced, batch_size=batch_size, model_name="GPT",
                    param_dtype_bytes=settings.get("param_dtype_bytes"),
                    reduce_dtype_bytes=settings.get("reduce_dtype_bytes"), **kw)


def test_plan_for_another_model_names_the_first_mismatch():
    plan = _plan_for(gpt())
    with pytest.raises(PlanMismatchError, match=r"prices unit 'wte' at 3880 bytes \(970 parameters\), the model's module 'wte' owns 1164"):
        osdp.OSDP(gpt(hidden=12), plan=plan)
    other = _plan_for(gpt(num_layers=3))
    with pytest.raises(PlanMismatchError, match=r"names unit 'blocks.2.ln_1', which is not a module of this model"):
        osdp.OSDP(gpt(), plan=other)
    osdp.OSDP(gpt(), plan=plan)  # its own model is fine


def test_batch_above_the_plan_raises_smaller_runs():
    model = osdp.OSDP(gpt(), plan=_plan_for(gpt(), batch_size=2))
    assert model.batch_size == 2 and model.plan is not None
    model(*example_batch(CFG, 1)).backward()
    model(*example_batch(CFG, 2)).backward()
    with pytest.raises(OSDPError, match=r"batch of 3 samples per device exceeds the plan's batch_size=2"):
        model(*example_batch(CFG, 3))


class _BatchDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, batch):
        return self.fc(batch["x"]).sum()


def test_a_batch_in_a_dict_is_checked_against_the_plan():
    """``model(batch)`` with the batch a dict: its first tensor is the batch, as auto mode
    planned it ([Note: example inputs and the loss])."""
    model = osdp.OSDP(_BatchDict(), plan=_plan_for(_BatchDict(), batch_size=2))
    model({"x": torch.randn(2, 4)}).backward()
    with pytest.raises(OSDPError, match=r"batch of 3 samples per device exceeds the plan's batch_size=2"):
        model({"x": torch.randn(3, 4)})


@pytest.mark.parametrize(
    "settings,mp,match",
    [
        ({"param_dtype_bytes": 2, "reduce_dtype_bytes": 4}, None, r"assumed 2-byte parameters and 4-byte .* 4-byte parameters and 4-byte"),
        ({}, dict(param_dtype=torch.bfloat16), r"assumed 4-byte parameters and 4-byte .* 2-byte parameters and 2-byte"),
        ({"param_dtype_bytes": 2, "reduce_dtype_bytes": 2}, dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), r"4-byte reduction"),
    ],
)
def test_plan_dtypes_must_match_mixed_precision(settings, mp, match):
    from osdp.runtime.mixed_precision import MixedPrecision

    policy = MixedPrecision(**mp) if mp else None
    with pytest.raises(PlanMismatchError, match=match):
        osdp.OSDP(gpt(), plan=_plan_for(gpt(), settings=settings), mixed_precision=policy)


def test_plan_dtypes_that_match_are_accepted():
    from osdp.runtime.mixed_precision import MixedPrecision

    plan = _plan_for(gpt(), settings={"param_dtype_bytes": 2, "reduce_dtype_bytes": 4})
    model = osdp.OSDP(gpt(), plan=plan, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    loss = model(*example_batch(CFG, 2))
    assert loss.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_mixed_precision_and_option_validation():
    from osdp.runtime.mixed_precision import MixedPrecision

    with pytest.raises(OSDPError, match="param_dtype must be a floating-point torch.dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(OSDPError, match="timeout_s must be a number of seconds > 0"):
        osdp.OSDP(gpt(), timeout_s=0)
    with pytest.raises(OSDPError, match="coalesce_bytes must be an integer >= 0"):
        osdp.OSDP(gpt(), coalesce_bytes=-1)
    with pytest.raises(OSDPError, match="no parameters: there is nothing to shard"):
        osdp.OSDP(nn.Sequential(nn.ReLU()))


def test_micro_batch_index_and_sync_switch():
    model = osdp.OSDP(gpt(), plan=_plan_for(gpt(), accumulation_steps=2, gradient_sync="last"))
    assert model.accumulation_steps == 2 and model.gradient_sync == "last"
    with pytest.raises(OSDPError, match=r"micro-batch index 2 out of range 0..1$"):
        with model.micro_batch(2):
            pass
    # without a plan there is one micro-batch: the error says how to accumulate by hand
    by_hand = osdp.OSDP(gpt(), default_mode="zdp")
    with pytest.raises(OSDPError, match=r"out of range 0..0: model.accumulation_steps is 1 without a plan.*"
                                        r"model.no_sync\(\)"):
        with by_hand.micro_batch(1):
            pass
    with model.micro_batch(0):
        assert model.requires_gradient_sync is False
    with model.micro_batch(1):
        assert model.requires_gradient_sync is True
    with model.no_sync():
        assert model.requires_gradient_sync is False
    model.set_requires_gradient_sync(False)
    assert model.requires_gradient_sync is False


def test_a_wrapped_model_keeps_its_options_and_they_build_a_twin():
    model = osdp.OSDP(gpt(), default_mode="zdp", coalesce_bytes=0, timeout_s=7, memory_check=False)
    assert model.options.coalesce_bytes == 0 and model.options.timeout_s == 7.0 and not model.options.memory_check
    twin = osdp.OSDP(gpt(), default_mode="zdp", **model.options.as_kwargs())
    assert twin.options == model.options
    idx, targets = example_batch(CFG, 2)
    torch.testing.assert_close(twin(idx, targets), model(idx, targets), rtol=0, atol=0)


def test_auto_mode_refuses_a_bad_option_before_profiling(monkeypatch):
    import osdp.entry

    monkeypatch.setattr(osdp.entry, "plan_with_values", lambda *a, **k: pytest.fail("profiled first"))
    with pytest.raises(OSDPError, match="timeout_s must be a number of seconds > 0"):
        osdp.OSDP(gpt(), memory_limit="1 GiB", example_inputs=example_batch(CFG, 2), timeout_s=-1)


def test_the_wrapped_models_methods_are_named_with_where_they_are():
    """``model.generate`` of a wrapped Hugging Face model says ``model.unwrapped.generate``
    (which runs on the shards: the plain model's tokens), ``save_pretrained`` points to
    ``save_hf``; what neither has stays a plain AttributeError, defaults still apply."""
    transformers = pytest.importorskip("transformers")
    from osdp.models.hf import GPT2_DEFAULTS

    config = transformers.GPT2Config(**GPT2_DEFAULTS)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    torch.manual_seed(0)
    model = osdp.OSDP(transformers.GPT2LMHeadModel(config), default_mode="zdp").eval()
    prompt = torch.arange(1, 7).view(1, 6)
    with pytest.raises(AttributeError, match=r"no attribute 'generate'.*model\.unwrapped\.generate"):
        model.generate(prompt)
    with pytest.raises(AttributeError, match=r"save_pretrained would write this rank's pieces.*save_hf"):
        model.save_pretrained("unused")
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_method'$"):
        model.no_such_method()
    assert getattr(model, "generation_config", None) is None and not hasattr(model, "config")
    with torch.no_grad():
        want = plain.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        got = model.unwrapped.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_copying_a_wrapped_model_is_refused_with_the_ema_that_works():
    """copy.deepcopy and AveragedModel failed on "cannot pickle 'ProcessGroup'"; the
    error's recipe (an EMA of this rank's pieces) gives plain PyTorch's EMA."""
    import copy
    import pickle

    from torch.optim.swa_utils import AveragedModel

    model = osdp.OSDP(gpt(), default_mode="zdp")
    for copying in (lambda: copy.deepcopy(model), lambda: AveragedModel(model)):
        with pytest.raises(OSDPError, match=r"cannot be copied.*ema = \[p.detach\(\).clone\(\)"):
            copying()
    with pytest.raises(OSDPError, match=r"cannot be pickled.*osdp.checkpoint"):
        pickle.dumps(model)
    plain = gpt()
    idx, tgt = example_batch(CFG, 2)
    emas = []
    for net in (model, plain):
        optim = torch.optim.SGD(net.parameters(), lr=0.1)
        ema = [p.detach().clone() for p in net.parameters()]
        for _ in range(3):
            net(idx, tgt).backward()
            optim.step()
            optim.zero_grad()
            for e, p in zip(ema, net.parameters()):
                e.lerp_(p.detach(), 1 - 0.9)
        with torch.no_grad():
            for e, p in zip(ema, net.parameters()):
                p.copy_(e)
            emas.append(net(idx, tgt))
    torch.testing.assert_close(emas[0], emas[1], rtol=1e-5, atol=1e-6)
