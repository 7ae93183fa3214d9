"""The grouped matmul of MoE experts in describe ([Note: grouped matmul] in
osdp/planner/grouped_mm.py): its FLOPs against the same product done group by group with
``torch.mm`` (counted by torch's own formula), its output on fake tensors against the CPU
kernel's, and a stock Hugging Face Mixtral described with its experts' FLOPs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from osdp.planner.grouped_mm import any_dtype_on_fake, flop_formulas

OFFS = [8, 8, 16, 24]  # 4 groups, one of them empty


def _bounds():
    return list(zip([0] + OFFS[:-1], OFFS))


def _layouts():
    """name -> (a, b, the product group by group): the four layouts the op takes, with
    strides of 16-byte multiples in 2-byte dtypes too (the CPU kernel asks for them)."""
    gen = torch.Generator().manual_seed(0)
    G, M, K, N, T = len(OFFS), 3, 8, 8, OFFS[-1]
    rows, a_rows, b_3d = torch.randn(T, K, generator=gen), torch.randn(G, M, K, generator=gen), \
        torch.randn(G, K, N, generator=gen)
    a_k, b_k = torch.randn(M, T, generator=gen), torch.randn(T, N, generator=gen)
    b_n = torch.randn(K, T, generator=gen)
    return {
        # tokens sorted by expert, one weight per expert: the MoE forward
        "2d x 3d": (rows, b_3d, lambda: torch.cat([rows[s:e] @ b_3d[g] for g, (s, e) in enumerate(_bounds())])),
        "3d x 3d": (a_rows, b_3d, lambda: torch.stack([a_rows[g] @ b_3d[g] for g in range(G)])),
        # the contraction cut into groups: the weight gradient's layout
        "2d x 2d": (a_k, b_k, lambda: torch.stack([a_k[:, s:e] @ b_k[s:e] for s, e in _bounds()])),
        "3d x 2d": (a_rows, b_n, lambda: torch.cat([a_rows[g] @ b_n[:, s:e] for g, (s, e) in enumerate(_bounds())],
                                                   dim=1)),
    }


def _offs(a, b):
    return torch.tensor(OFFS, dtype=torch.int32) if 2 in (a.dim(), b.dim()) else None


@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_flops_are_the_group_by_group_matmuls(layout):
    a, b, by_groups = _layouts()[layout]
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as grouped:
        out = F.grouped_mm(a, b, offs=_offs(a, b))
    with FlopCounterMode(display=False) as reference:
        want = by_groups()
    torch.testing.assert_close(out, want)  # the layout read as the kernel computes it
    assert grouped.get_total_flops() == reference.get_total_flops() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_fake_output_is_the_cpu_kernels(layout, dtype):
    """fp32 and fp16 are refused by the meta kernel (bf16 only) and run on CPU."""
    a, b, _ = _layouts()[layout]
    a, b = a.to(dtype), b.to(dtype)
    real = F.grouped_mm(a, b, offs=_offs(a, b))
    fake_mode = FakeTensorMode()
    fa, fb = fake_mode.from_tensor(a), fake_mode.from_tensor(b)
    offs = _offs(a, b)
    offs = fake_mode.from_tensor(offs) if offs is not None else None
    with fake_mode, any_dtype_on_fake():
        fake = F.grouped_mm(fa, fb, offs=offs)
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)


def test_fake_bad_layout_is_still_refused():
    fake_mode = FakeTensorMode()
    a = fake_mode.from_tensor(torch.randn(24, 8))
    b = fake_mode.from_tensor(torch.randn(8, 8))
    with fake_mode, any_dtype_on_fake(), pytest.raises(RuntimeError, match="Offsets tensor not provided"):
        F.grouped_mm(a, b)


@pytest.mark.parametrize("fake", [False, True])
def test_mixtral_experts_are_described_with_their_flops(fake):
    """Each token runs through 2 of 4 experts, each a gate-and-up (H -> 2I) and a down
    (I -> H) projection: 2 * tokens * 2 * 3 * H * I forward FLOPs per sample. They were
    0 (no formula), and on the meta device describe raised (bf16-only meta kernel)."""
    hf = pytest.importorskip("osdp.models.hf")
    pytest.importorskip("transformers")
    from osdp.planner.description import describe

    torch.manual_seed(0)
    if fake:
        with torch.device("meta"):
            model = hf.mixtral_model()
    else:
        model = hf.mixtral_model()
    batch, seq = 4, 8
    idx, targets = hf.example_batch(model.config.vocab_size, batch, seq)
    desc = describe(model, (idx, targets))
    experts = [op for op in desc.ops if op.name.endswith("mlp.experts")]
    assert len(experts) == model.config.num_hidden_layers
    c = model.config
    per_sample = 2 * seq * c.num_experts_per_tok * 3 * c.hidden_size * c.intermediate_size
    assert all(op.flops_per_sample == per_sample for op in experts)


def test_meta_mixtral_with_its_experts_in_a_loop_is_told_the_kernel_that_describes():
    hf = pytest.importorskip("osdp.models.hf")
    pytest.importorskip("transformers")
    from osdp.errors import OSDPError
    from osdp.planner.description import describe

    with torch.device("meta"):
        model = hf.mixtral_model(experts_implementation="eager")  # one expert at a time, over nonzero()
    with pytest.raises(OSDPError, match='cannot be described without real data.*experts_implementation="grouped_mm"'):
        describe(model, hf.example_batch(model.config.vocab_size, 2))
