"""Stock Hugging Face code that would run different modules on different ranks keeps
them in step under OSDP, as under FSDP2: OSDP marks the model sharded ([Note: ranks in
lockstep] in osdp/runtime/lockstep.py). Without the mark, the LayerDrop case aborted
(gloo: "Received data size doesn't match expected size") and the generate case timed
out on the rank still generating."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

from runtime.dist_harness import spawn  # noqa: E402

from . import lockstep_cases as lc  # noqa: E402

WORLD = 2
_RESULTS: list = []


@pytest.fixture(scope="module")
def results():
    if not _RESULTS:
        _RESULTS.append(spawn(lc.run, WORLD))
    return _RESULTS[0]


def test_ranks_draw_different_layer_skips():
    """The premise: unsynced, the ranks would skip different layers in the first step."""
    def skips(rank):
        torch.manual_seed(lc.rank_seed(rank))
        return [bool(torch.rand([]) < lc.LAYERDROP) for _ in range(lc.LAYERS)]

    assert skips(0) != skips(1)


def test_layerdrop_runs_every_layer_on_every_rank(results):
    """HF's sharded path runs every layer: single-process training without LayerDrop."""
    assert all(r["marked"] for r in results)
    reference = lc.build_wav2vec2(0.0)
    ref_losses = lc.train_wav2vec2(reference, WORLD, None)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_generate_of_different_lengths_per_rank(results):
    plain = lc.build_llama().eval()
    for rank, r in enumerate(results):
        want = lc.generate(plain, rank)
        assert want.shape[1] == 3 + lc.new_tokens(rank)
        assert torch.equal(r["tokens"], want)
