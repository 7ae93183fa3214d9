"""Plan a Hugging Face model from its ``config.json`` alone: read the config (offline),
build the model on the meta device, describe it on fake tensors. Nothing of the
model's size is allocated and nothing is downloaded.

    desc = describe_hf_config("llama-3-8b")          # a shipped config (osdp/configs/hf/)
    desc = describe_hf_config("path/to/config.json", seq_len=2048, dtype_bytes=2)

Every bad input is one ``OSDPError`` line: a missing file, text that is not JSON, a
JSON that is not a config object, a ``model_type`` that ``transformers`` does not know,
a config it refuses, a model type without a causal LM class.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import OSDPError
from ..planner.checks import read_json_file
from ..planner.description import describe

HF_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "hf"
# without --seq: the config's context length, capped here (activations grow with it)
DEFAULT_MAX_SEQ = 4096
DESCRIBE_BATCH = 2  # two samples: describe halves the batch to separate constant bytes


def available_hf_configs() -> list[str]:
    return sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))


def resolve_hf_config(name_or_path: str) -> Path:
    """A shipped config by short name (``llama-2-7b``) or a path to a JSON file."""
    path = Path(name_or_path)
    if not path.exists() and not path.suffix and (HF_CONFIG_DIR / f"{name_or_path}.json").exists():
        path = HF_CONFIG_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise OSDPError(
            f"Hugging Face config {name_or_path!r}: no such file, and not a shipped config "
            f"({', '.join(available_hf_configs())})"
        )
    if path.is_dir():
        raise OSDPError(f"Hugging Face config {name_or_path!r} is a directory; give its config.json")
    return path


def _transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"  # this path never downloads
    try:
        import transformers
    except ImportError:
        raise OSDPError("--hf-config needs the `transformers` package: pip install transformers") from None
    return transformers


def load_hf_config(name_or_path: str):
    """The ``PretrainedConfig`` of a shipped name or a local ``config.json``."""
    path = resolve_hf_config(name_or_path)
    data = read_json_file(path, "Hugging Face config")
    if not isinstance(data, dict):
        raise OSDPError(f"Hugging Face config {path} must be a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise OSDPError(f"Hugging Face config {path} has no \"model_type\" (e.g. \"llama\", \"gpt2\")")
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise OSDPError(
            f"Hugging Face config {path}: unknown model_type {model_type!r}; transformers "
            f"{tf.__version__} knows {len(list(CONFIG_MAPPING.keys()))} types, e.g. gpt2, llama, mistral, qwen2"
        )
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return tf.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' and huggingface_hub's validators raise many kinds
        raise OSDPError(f"Hugging Face config {path} is not a valid {model_type} config: {_root_cause(exc)}") from None


def _root_cause(exc: BaseException) -> str:
    """The innermost cause's first line (validators wrap the message that matters)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def context_length(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def meta_causal_lm(config, dtype_bytes: int = 4):
    """``AutoModelForCausalLM.from_config(config)`` on the meta device, in fp32
    (``dtype_bytes`` 4) or bf16 (2): shapes only, no memory."""
    import torch

    tf = _transformers()
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes)
    if dtype is None:
        raise OSDPError(f"dtype bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes}")
    try:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:
        raise OSDPError(f"model_type {config.model_type!r} has no causal LM in transformers: "
                        f"{_root_cause(exc)}") from None
    except Exception as exc:
        raise OSDPError(f"transformers could not build a {config.model_type} model from this config: "
                        f"{type(exc).__name__}: {_root_cause(exc)}") from None
    return model


def describe_hf_config(name_or_path: str, *, seq_len: int | None = None, dtype_bytes: int = 4,
                       name: str | None = None):
    """The ``ModelDesc`` of the model a Hugging Face config describes, measured on fake
    tensors at ``seq_len`` tokens per sample (default: the config's context length,
    capped at ``DEFAULT_MAX_SEQ``). The loss is the model's own (``labels=``)."""
    import torch

    config = load_hf_config(name_or_path)
    context = context_length(config)
    if seq_len is None:
        seq_len = min(context or DEFAULT_MAX_SEQ, DEFAULT_MAX_SEQ)
    if seq_len < 1:
        raise OSDPError(f"sequence length must be positive, got {seq_len}")
    if context is not None and seq_len > context:
        raise OSDPError(f"sequence length {seq_len} exceeds the model's context length {context}")
    model = meta_causal_lm(config, dtype_bytes)
    model.train()
    ids, labels = (torch.empty(DESCRIBE_BATCH, seq_len, dtype=torch.long, device="meta") for _ in range(2))
    label = name or Path(name_or_path).stem
    with _quiet_transformers():
        try:
            return describe(model, {"input_ids": ids, "labels": labels, "use_cache": False}, name=label, fake=True)
        except OSDPError:
            raise
        except Exception as exc:
            raise OSDPError(f"describing the {config.model_type} model of {name_or_path} on fake tensors failed: "
                            f"{type(exc).__name__}: {_root_cause(exc)}") from None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings about config fields (``loss_type=None`` ...) are not the
    user's business here; errors still show."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
