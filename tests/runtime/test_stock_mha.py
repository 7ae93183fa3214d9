"""Stock ``nn.TransformerEncoder`` layers on 2 gloo ranks against one process
(stock_mha_cases.py), with no ``leaf_modules``: ``nn.MultiheadAttention`` computes with
its ``out_proj.weight`` inside ``F.multi_head_attention_forward``, so as a unit of its
own that weight was read outside its unit and every run was refused until the user
named the class. It is a leaf by default now ([Note: leaf modules] in
osdp/module_tree.py), by hand, compiled and in the planner's plans; the trained models
are evaluated under no_grad too."""
from __future__ import annotations

import pytest
import torch

from . import stock_mha_cases as sc
from .dist_harness import spawn

WORLD = 2
CONFIGS = ["zdp_batch_first", "dp_seq_first", "planned_batch_first", "compiled_batch_first"]


@pytest.fixture(scope="module")
def results():
    return spawn(sc.run, WORLD, CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_stock_encoder_layers_train_as_one_process(results, config):
    plain = sc.build(config.endswith("batch_first"))
    losses = sc.train(plain, None, WORLD)
    for rank_result in results:
        got = rank_result[config]
        assert "encoder.layers.0.self_attn" in got["units"]  # one unit: in_proj and out_proj
        assert not any(name.startswith("encoder.layers.0.self_attn.") for name in got["units"])
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        # compiled, the encoder layers' fused eval path read their children's freed
        # weights and was refused ([Note: fused layer fast path] in osdp/runtime/compiled.py)
        torch.testing.assert_close(got["eval"], sc.evaluated(plain), rtol=1e-4, atol=1e-5)
