"""osdp.RuntimeOptions: the runtime keywords of osdp.OSDP checked into one record."""
from __future__ import annotations

import pytest
import torch

import osdp
from osdp.runtime.options import OPTION_KEYWORDS, RuntimeOptions


def test_defaults_resolve_the_device_and_the_coalescing_size():
    options = RuntimeOptions.from_args()
    assert options.device == torch.device("cpu")
    assert options.coalesce_bytes > 0 and options.compile is None and options.memory_limit_bytes is None


def test_as_kwargs_gives_the_same_options_back():
    options = RuntimeOptions.from_args(device="cpu", mixed_precision=osdp.MixedPrecision(param_dtype=torch.bfloat16),
                                       coalesce_bytes=0, timeout_s=5, memory_limit="3 MiB", memory_check=False,
                                       compile="model")
    assert RuntimeOptions.from_args(**options.as_kwargs()) == options
    assert options.memory_limit_bytes == 3 * 2**20 and options.compile == osdp.CompileConfig(scope="model")
    assert set(options.as_kwargs()) == set(OPTION_KEYWORDS) | {"memory_limit"}


@pytest.mark.parametrize("kwargs, says", [
    (dict(timeout_s=0), "timeout_s must be a number of seconds > 0"),
    (dict(timeout_s=True), "timeout_s must be a number of seconds > 0"),
    (dict(coalesce_bytes=-1), "coalesce_bytes must be an integer >= 0"),
    (dict(coalesce_bytes=1.5), "coalesce_bytes must be an integer >= 0"),
    (dict(mixed_precision=torch.bfloat16), "mixed_precision must be an osdp MixedPrecision"),
    (dict(memory_check="no"), "memory_check must be True or False"),
    (dict(sync_module_states=1), "sync_module_states must be True or False"),
    (dict(device="gpu0"), "is not a device name PyTorch knows"),
    (dict(compile=3), "compile=3"),
])
def test_a_bad_option_names_itself_and_what_would_be_right(kwargs, says):
    with pytest.raises(osdp.OSDPError, match=says):
        RuntimeOptions.from_args(**kwargs)


def test_the_memory_check_switch_reads_the_environment(monkeypatch):
    options = RuntimeOptions.from_args()
    monkeypatch.setenv("OSDP_MEMORY_CHECK", "0")
    assert not options.memory_check_on
    monkeypatch.setenv("OSDP_MEMORY_CHECK", "1")
    assert options.memory_check_on and not options.replace(memory_check=False).memory_check_on
