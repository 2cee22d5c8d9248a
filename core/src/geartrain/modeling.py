"""Building transformers models and tokenizers from a :class:`~geartrain.config.ModelConfig`.

Backends call these so that every engine and rollout builds *the same* model from the same
config: a tiny random model from its seed, or a checkpoint from a hub id / directory / GGUF
file (``model.path`` is read through :func:`geartrain.gguf_source.hf_path`, which turns a
GGUF source into its dequantized Hugging Face directory).

The tiny models (``model.tiny = "qwen2" | "llama"``) and the character tokenizer are built in
code, with no download: the same ``(family, seed, overrides)`` always gives the same weights,
in any process. The CPU main job trains them; tests and the conformance suites use them
(:mod:`geartrain.testing` re-exports them).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from geartrain.char_tokenizer import BOS, CHARACTERS, CHAT_TEMPLATE, EOS, PAD, UNK, char_tokenizer
from geartrain.config import ModelConfig
from geartrain.errors import GeartrainError, unpickling_reason
from geartrain.gguf_source import hf_path

__all__ = [
    "BOS",
    "CHARACTERS",
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "UNK",
    "TINY_CONFIGS",
    "Family",
    "build_hf_model",
    "hf_config",
    "load_tokenizer",
    "model_directory",
    "pad_token_id",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
    "torch_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return _DTYPES[name]


def hf_config(config: ModelConfig) -> PretrainedConfig:
    """The transformers config the model is built from (overrides applied)."""
    if config.tiny is not None:
        hf = tiny_config(config.tiny, **config.config_overrides)
    elif config.preset is not None:
        from geartrain.presets import preset_config

        hf = preset_config(config.preset, **config.config_overrides)
    else:
        hf = AutoConfig.from_pretrained(hf_path(config.path), trust_remote_code=config.trust_remote_code)
        for key, value in config.config_overrides.items():
            setattr(hf, key, value)
    if config.value_head:
        hf.num_labels = 1
        # Token-classification heads default to dropout 0.1; a value model must be a
        # deterministic function of its weights (train and forward-only agree).
        hf.classifier_dropout = 0.0
    return hf


def refused_pickle(path: str, exc: BaseException) -> GeartrainError:
    """The one line for model weights in a pickle that holds more than tensors."""
    return GeartrainError(
        f"model.path '{path}': refusing to load its weights: a pickle file (pytorch_model.bin) holds objects other "
        f"than tensors ({unpickling_reason(exc)}); geartrain never unpickles code. Use the model's safetensors "
        "weights, or convert trusted weights to safetensors"
    )


def pickled_weights_problem(path: str) -> str | None:
    """What is wrong with the pickle weight files (``*.bin``) of the local model directory
    ``path``, read without running code or loading tensors (``None``: nothing, or the model
    has safetensors weights, which transformers prefers)."""
    directory = Path(path)
    if not directory.is_dir() or any(directory.glob("*.safetensors")):
        return None
    for file in sorted(directory.glob("*.bin")):
        try:
            torch.load(file, weights_only=True, mmap=True, map_location="meta")
        except pickle.UnpicklingError as exc:
            return str(refused_pickle(path, exc)).replace("a pickle file (pytorch_model.bin)", f"{file.name}")
        except Exception:  # noqa: BLE001 - an old or other format: the load itself reports it
            continue
    return None


#: Files that hold a model's weights in the formats transformers loads.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.msgpack", "*.h5", "*.ckpt")


def missing_weights_problem(path: str) -> str | None:
    """What is wrong when the local model directory ``path`` has a ``config.json`` and no
    weight file (``None``: it has one, or is no local model directory): copied without its
    weights, it is no model, and the build would fail only after the run began."""
    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        return None
    if any(any(directory.glob(pattern)) for pattern in WEIGHT_FILES):
        return None
    return (
        f"{directory} holds a model's config.json but no weight file (*.safetensors, pytorch_model.bin): "
        "a model directory copied without its weights; copy them too"
    )


def weight_shapes_problem(path: str, module: torch.nn.Module) -> str | None:
    """The first weight of the local model directory ``path``'s safetensors files whose shape
    differs from the one ``module`` (built from its config, on the meta device) gives it, read
    from the files' headers (``None``: every weight they share has its shape). A config.json
    that does not describe its weights (another vocabulary size, width or depth) otherwise
    fails in transformers' load, after the run began, in a long report."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        return None
    expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    want = next(
                        (expected[k] for k in (key, f"model.{key}", key.removeprefix("model.")) if k in expected),
                        None,
                    )
                    shape = tuple(handle.get_slice(key).get_shape())
                    if want is not None and shape != want:
                        return (
                            f"{file.name}: weight '{key}' is {list(shape)} where the model its config.json describes "
                            f"has {list(want)}: the config does not match the weights (vocab_size, hidden_size, "
                            "num_attention_heads, ... or model.config_overrides)"
                        )
        except Exception:  # noqa: BLE001 - an unreadable file is named by unreadable_safetensors_problem
            continue
    return None


def build_hf_model(config: ModelConfig, *, device: str | torch.device = "cpu", meta: bool = False) -> torch.nn.Module:
    """Build the causal LM (or, with ``config.value_head``, a token-classification model
    with one label: a per-token value) that ``config`` describes.

    Tiny and preset models are initialised from ``config.seed`` (identical across
    processes); ``path``
    models load their weights, unless ``meta`` asks for an empty module on the meta device
    (the caller then loads weights itself, e.g. broadcast from rank 0).
    """
    hf = hf_config(config)
    dtype = torch_dtype(config.dtype)
    auto = AutoModelForTokenClassification if config.value_head else AutoModelForCausalLM
    kwargs: dict[str, Any] = dict(
        attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code
    )
    if meta:
        with torch.device("meta"):
            model = auto.from_config(hf, dtype=dtype, **kwargs)
        return model
    if config.path is not None:
        try:
            model = auto.from_pretrained(hf_path(config.path), config=hf, dtype=dtype, **kwargs)
        except pickle.UnpicklingError as exc:  # transformers loads .bin weights with weights_only=True
            raise refused_pickle(config.path, exc) from None
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = auto.from_config(hf, dtype=dtype, **kwargs)
    return model.to(device)


def load_tokenizer(config: ModelConfig) -> Any:
    """The tokenizer for ``config``: ``tokenizer`` or ``path``, or the built-in character
    tokenizer for tiny models (padded to the real vocabulary size for presets)."""
    source = hf_path(config.tokenizer or config.path)
    if source is None and config.preset is not None:
        from geartrain.presets import preset_tokenizer

        return preset_tokenizer(config.preset)
    if source is None:
        return tiny_tokenizer()
    return AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)


def stop_token_ids(config: ModelConfig, tokenizer: Any) -> list[int]:
    """The token ids that end a response: the tokenizer's EOS, then every ``eos_token_id``
    of the model's ``generation_config.json``, which chat models list several of (Qwen2.5's
    ``<|im_end|>`` and ``<|endoftext|>``, Llama 3.x's ``<|eot_id|>`` and ``<|eom_id|>``,
    Gemma's ``<end_of_turn>``): TRL and vLLM stop on all of them. Only the tokenizer's for
    a model without that file (tiny models, presets)."""
    ids = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    if config.path is None:
        return ids
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(
            hf_path(config.path), trust_remote_code=config.trust_remote_code
        ).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS alone
        return ids
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        if int(token) not in ids:
            ids.append(int(token))
    return ids


def model_directory(config: ModelConfig, work_dir: str | Path) -> Path:
    """A Hugging Face directory (``config.json``, weights, tokenizer) for an inference engine
    that loads models only from one (vLLM, SGLang).

    A ``path`` without ``config_overrides`` is returned as is (a local directory, or a hub id
    the engine resolves). A tiny model, or a ``path`` with ``config_overrides`` (which the
    engine could not apply), is built with :func:`build_hf_model` and written, with its
    tokenizer, under ``work_dir/model``, by this process whatever its ``torch.distributed``
    rank (every rank of a multi-rank job starts its own engine from its own directory)."""
    if config.path is not None and not config.config_overrides:
        return Path(hf_path(config.path))  # type: ignore[arg-type]
    target = Path(work_dir) / "model"
    target.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(config)
    # transformers writes only on torch.distributed rank 0
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
    model.save_pretrained(target, safe_serialization=True)
    load_tokenizer(config).save_pretrained(target)
    del model
    return target


def pad_token_id(config: ModelConfig, override: int | None = None) -> int:
    """The id a rollout writes into padding positions: ``override``, else the model
    config's ``pad_token_id``, else 0."""
    if override is not None:
        return override
    pad = getattr(hf_config(config), "pad_token_id", None)
    return int(pad) if pad is not None else 0


# --------------------------------------------------------------------------- tiny models

Family = Literal["qwen2", "llama"]

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with ``<pad>`` (0), ``<s>`` (1),
    ``</s>`` (2), ``<unk>`` (3) and a plain ``role: content`` chat template."""
    return char_tokenizer()


def tiny_config(family: Family = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A transformers config of a tiny ``family`` model sized for the tiny tokenizer."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(TINY_CONFIGS)}")
    fields = dict(TINY_CONFIGS[family])
    fields.update(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(family: Family = "qwen2", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM (fp32, eval mode), the same for the same
    arguments in any process."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()
