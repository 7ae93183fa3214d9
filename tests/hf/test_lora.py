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
