"""Hugging Face's Trainer drives an OSDP model (one rank) as it drives the plain one:
the same logged losses and gradient norms, the same weights after the steps. It clips
through accelerate, that is torch.nn.utils.clip_grad_norm_, which refused OSDP's
gradients ([Note: global gradient norm] in osdp/runtime/grad_norm.py). It reads the
model's forward signature to drop the dataset columns it does not take: the wrapper's
forward declares the wrapped model's parameters (with ``*args, **kwargs`` the Trainer
dropped every column)."""
from __future__ import annotations

import inspect

import pytest

transformers = pytest.importorskip("transformers", reason="needs `pip install transformers`")
pytest.importorskip("accelerate", reason="Trainer needs `pip install accelerate`")

import torch  # noqa: E402

import osdp  # noqa: E402

from . import hf_cases as hc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _train(model, out_dir) -> tuple[list, list]:
    tokens = torch.randint(0, hc.VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t, "row": i} for i, t in enumerate(tokens)]  # "row": not the model's
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, max_grad_norm=0.5,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [e["loss"] for e in logs], [e["grad_norm"] for e in logs]


def test_trainer_trains_an_osdp_model_as_the_plain_one(tmp_path):
    plain = hc.make_model("gpt2", raw=True)
    wrapped = osdp.OSDP(hc.make_model("gpt2", raw=True), default_mode="zdp", splits={"transformer.h.0.mlp.c_fc": 2})
    plain_losses, plain_norms = _train(plain, tmp_path / "plain")
    losses, norms = _train(wrapped, tmp_path / "osdp")
    assert inspect.signature(wrapped.forward) == inspect.signature(plain.forward)
    assert len(losses) == 4 and losses == pytest.approx(plain_losses, rel=1e-5)
    assert norms == pytest.approx(plain_norms, rel=1e-5) and max(plain_norms) > 0.5  # clipped
    state = wrapped.full_state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
