"""Auto mode on a vision-language model whose image inputs are packed: stock Qwen2-VL
takes ``pixel_values`` as (patches of every image, features) and ``image_grid_thw`` one
row per image, so dim 0 of ``pixel_values`` is not the batch and the profiler's other
batch sizes cannot be cut from the example along dim 0. The run failed deep inside the
vision tower (a shape mismatch in its rotary embedding); ``ExampleInputs(at_batch=fn)``
makes them now, and without it the failure names the tensor ([Note: example inputs and
the loss] in osdp/planner/inputs.py). One process (a 1-rank group)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

import osdp  # noqa: E402
from osdp.errors import OSDPError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

VOCAB, SEQ, IMAGE, START, END = 96, 10, 90, 92, 93
AUTO = dict(comm_sizes=(4096, 65536), repeats=1, progress=False)


def _model():
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4},
                         bos_token_id=0, eos_token_id=1, pad_token_id=0),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, in_channels=3, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=91, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config)


def _batch(batch: int, seed: int = 0) -> dict:
    """One 4x4-patch image a sample: 16 patches, 4 image tokens after the 2x2 merge."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 89, (batch, SEQ), generator=gen)
    ids[:, 1], ids[:, 2:6], ids[:, 6] = START, IMAGE, END
    return {"input_ids": ids, "pixel_values": torch.randn(batch * 16, 3 * 2 * 2 * 2, generator=gen),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * batch), "mm_token_type_ids": (ids == IMAGE).long(),
            "labels": ids}


def test_auto_mode_plans_packed_images_through_at_batch_and_trains_as_the_plain_model(tmp_path):
    inputs = osdp.ExampleInputs((), _batch(2), at_batch=_batch)
    wrapped = osdp.OSDP(_model(), memory_limit="8MiB", example_inputs=inputs,
                        auto_kwargs=dict(cache_dir=str(tmp_path), **AUTO))
    batch = wrapped.plan.batch_size
    assert batch > 2  # planned beyond the example: the profiler ran other batch sizes
    plain = _model()
    losses = {}
    for name, model in (("osdp", wrapped), ("plain", plain)):
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(2):
            loss = model(**_batch(batch, seed=step + 1)).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[name].append(loss.item())
    assert losses["osdp"] == pytest.approx(losses["plain"], rel=1e-5)


def test_packed_images_without_at_batch_name_the_tensor_left_as_given(tmp_path):
    with pytest.raises(OSDPError, match=r"passed as given: pixel_values \(32, 24\).*at_batch=fn"):
        osdp.auto_plan(_model(), _batch(2), "8MiB", cache_dir=str(tmp_path), **AUTO)
