"""megatron-core ``GPTModel`` chunks from a Hugging Face Llama / Qwen2 config, and
loading HF weights into any TP/PP/VPP layout through :mod:`geartrain_megatron.convert`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from geartrain_megatron.compat import needed as on_cpu
from geartrain_megatron.convert import Dims, rule_for
from geartrain_megatron.parallel import Layout

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def dims_of(hf_config, tp: int) -> Dims:  # noqa: ANN001
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    vocab = hf_config.vocab_size
    return Dims(
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp
    )


def check_supported(hf_config, layout: Layout) -> None:  # noqa: ANN001
    """Raise ``ValueError`` for a model this engine cannot map or split as asked."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type '{model_type}': the megatron engine maps {', '.join(SUPPORTED_MODEL_TYPES)} models"
        )
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling '{rope_type}' is not mapped by the megatron engine yet")
    dims = dims_of(hf_config, layout.tp)
    if dims.num_kv_heads % layout.tp:
        raise ValueError(f"parallel.tp={layout.tp} must divide the {dims.num_kv_heads} key/value heads")
    if hf_config.intermediate_size % layout.tp:
        raise ValueError(f"parallel.tp={layout.tp} must divide intermediate_size={hf_config.intermediate_size}")
    stages = layout.pp * (layout.vpp or 1)
    if hf_config.num_hidden_layers % stages:
        raise ValueError(f"parallel.pp * vpp = {stages} must divide the model's {hf_config.num_hidden_layers} layers")


def transformer_config(hf_config, layout: Layout, *, recompute: bool):  # noqa: ANN001, ANN201
    """megatron's ``TransformerConfig`` for a Llama/Qwen2 ``hf_config`` (fp32, no dropout:
    a training step must be a deterministic function of the weights and the batch)."""
    from megatron.core.transformer import TransformerConfig

    dims = dims_of(hf_config, layout.tp)
    extra = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        # micro-batches of different shapes (padding removed per micro-batch): the stages
        # exchange shapes before each activation
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # gloo matches messages between two ranks by order; batched p2p then pairs the
        # activation and the gradient of interleaved stages wrongly when pp = 2 (measured)
        batch_p2p_comm=not on_cpu(),  # the default (allgather) refuses variable lengths
        use_cpu_initialization=on_cpu(),
        perform_initialization=False,  # every weight is loaded from the HF model
        **extra,
    )


class ValueHead(nn.Linear):
    """The critic's ``score`` layer in place of megatron's output layer (same call
    signature: returns ``(output, bias)``). Replicated over tensor-parallel ranks."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1, bias=True)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):  # noqa: ANN001, ANN201
        return super().forward(hidden), None


def layer_spec(use_te: bool):  # noqa: ANN201
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_chunks(hf_config, layout: Layout, *, value_head: bool, recompute: bool, use_te: bool) -> list[nn.Module]:  # noqa: ANN001
    """One ``GPTModel`` per virtual pipeline stage this rank holds (one without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    check_supported(hf_config, layout)
    config = transformer_config(hf_config, layout, recompute=recompute)
    dims = dims_of(hf_config, layout.tp)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    spec = layer_spec(use_te)
    chunks: list[nn.Module] = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=dims.padded_vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=int(getattr(hf_config, "rope_theta", 10000)),
            vp_stage=vp_stage,
        )
        if value_head and post:
            model.output_layer = ValueHead(hf_config.hidden_size)
        chunks.append(model)
    return chunks


def chunk_rules(chunk: nn.Module, hf_config, *, value_head: bool):  # noqa: ANN001, ANN201
    """``[(megatron name, parameter, Rule)]`` for every parameter of ``chunk``."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])

    def global_layer(local: int) -> int:
        return layers[local].layer_number - 1  # megatron numbers layers from 1, globally

    return [
        (name, param, rule_for(name, global_layer, tied=tied, value_head=value_head))
        for name, param in chunk.named_parameters()
    ]


@torch.no_grad()
def load_hf_weights(
    chunks: list[nn.Module],
    get: Callable[[str], torch.Tensor],
    hf_config,
    layout: Layout,
    *,
    value_head: bool,  # noqa: ANN001
) -> None:
    """Fill every parameter of this rank's chunks from full HF tensors ``get(name)``."""
    dims = dims_of(hf_config, layout.tp)
    for chunk in chunks:
        for name, param, rule in chunk_rules(chunk, hf_config, value_head=value_head):
            local = rule.to_shard(get, dims, layout.tp, layout.tp_rank)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: the HF weights give shape {tuple(local.shape)}, megatron expects {tuple(param.shape)}"
                )
            param.copy_(local)
            _mark_tensor_parallel(param, rule.kind)


_SPLIT_DIM = {"rows": 0, "vocab": 0, "qkv": 0, "gated": 0, "cols": 1}


def _mark_tensor_parallel(param: nn.Parameter, kind: str) -> None:
    """megatron sets these attributes only when it initialises weights itself; the gradient
    norm and clipping need them to count each TP shard once (and replicated tensors once)."""
    from megatron.core import tensor_parallel

    if kind in _SPLIT_DIM and getattr(param, "tensor_model_parallel", None) is None:
        tensor_parallel.set_tensor_model_parallel_attributes(param, True, _SPLIT_DIM[kind], 1)
