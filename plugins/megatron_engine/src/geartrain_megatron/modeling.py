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

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mixtral")
MOE_MODEL_TYPES = ("mixtral",)


def num_experts(hf_config) -> int | None:  # noqa: ANN001
    """Routed experts per MoE layer (Mixtral layout: every layer is MoE); ``None`` for a dense model."""
    if getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES:
        return int(hf_config.num_local_experts)
    return None


def dims_of(hf_config, tp: int) -> Dims:  # noqa: ANN001
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    vocab = hf_config.vocab_size
    return Dims(
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp
    )


def rope_theta(hf_config) -> float:  # noqa: ANN001
    """The rotary base: transformers 5 keeps it in ``rope_parameters`` (``rope_theta`` as
    an attribute is gone there; reading it with a default silently gave 10000)."""
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


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
    if num_experts(hf_config):
        if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise ValueError(
                "router_jitter_noise != 0 is not mapped by the megatron engine (routing must be deterministic)"
            )
        if layout.tp > 1:
            # megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism
            raise ValueError(
                f"parallel.tp={layout.tp}: a MoE model needs megatron's sequence parallelism at tp > 1, which this "
                "engine does not enable yet; split the experts with options.expert_parallel instead"
            )
        if layout.ep > 1 and num_experts(hf_config) % layout.ep:
            raise ValueError(f"options.expert_parallel={layout.ep} must divide the {num_experts(hf_config)} experts")
    if hf_config.num_hidden_layers % stages:
        raise ValueError(f"parallel.pp * vpp = {stages} must divide the model's {hf_config.num_hidden_layers} layers")


def transformer_config(hf_config, layout: Layout, *, recompute: bool, router_replay: bool = False):  # noqa: ANN001, ANN201
    """megatron's ``TransformerConfig`` for a Llama/Qwen2/Mixtral ``hf_config`` (fp32, no
    dropout: a training step must be a deterministic function of the weights and the batch).

    Mixtral's routing is megatron's top-k softmax router without pre-softmax (softmax over
    the chosen experts' logits, which equals HF's softmax-then-renormalise), no load-balancing
    or z-loss (HF adds its aux loss only with ``output_router_logits``) and no token
    dropping, so the MoE layer computes exactly the HF block."""
    from megatron.core.transformer import TransformerConfig

    dims = dims_of(hf_config, layout.tp)
    extra = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    experts = num_experts(hf_config)
    if experts:
        extra.update(
            num_moe_experts=experts,
            moe_router_topk=int(hf_config.num_experts_per_tok),
            moe_ffn_hidden_size=hf_config.intermediate_size,
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_enable_routing_replay=router_replay,
            expert_model_parallel_size=layout.ep,
        )
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
        # gloo matches messages between two ranks by order; batched p2p then pairs the
        # activation and the gradient of interleaved stages wrongly when pp = 2 (measured)
        batch_p2p_comm=not on_cpu(),  # the default (allgather) refuses variable lengths
        use_cpu_initialization=on_cpu(),
        perform_initialization=False,  # every weight is loaded from the HF model
        # the only dispatcher that takes variable sequence lengths (its side CUDA stream
        # has a CPU stand-in in cpu_compat)
        moe_token_dispatcher_type="alltoall",
        **extra,
    )


class ValueHead(nn.Linear):
    """The critic's ``score`` layer in place of megatron's output layer (same call
    signature: returns ``(output, bias)``). Replicated over tensor-parallel ranks."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1, bias=True)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):  # noqa: ANN001, ANN201
        return super().forward(hidden), None


def layer_spec(use_te: bool, experts: int | None = None):  # noqa: ANN201
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False)
    return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")


def build_chunks(  # noqa: ANN001
    hf_config, layout: Layout, *, value_head: bool, recompute: bool, use_te: bool, router_replay: bool = False
) -> list[nn.Module]:
    """One ``GPTModel`` per virtual pipeline stage this rank holds (one without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    check_supported(hf_config, layout)
    if num_experts(hf_config):
        _fix_moe_without_te()
    config = transformer_config(hf_config, layout, recompute=recompute, router_replay=router_replay)
    dims = dims_of(hf_config, layout.tp)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    spec = layer_spec(use_te, num_experts(hf_config))
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
            rotary_base=rope_theta(hf_config),
            vp_stage=vp_stage,
        )
        if value_head and post:
            model.output_layer = ValueHead(hf_config.hidden_size)
        chunks.append(model)
    return chunks


def _fix_moe_without_te() -> None:
    """megatron-core 0.16's router linear tests ``te_general_gemm is not None`` but only
    defines the name when TransformerEngine imports (NameError otherwise)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def chunk_rules(chunk: nn.Module, hf_config, *, value_head: bool):  # noqa: ANN001, ANN201
    """``[(megatron name, parameter, Rule)]`` for every parameter of ``chunk``."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])

    def global_layer(local: int) -> int:
        return layers[local].layer_number - 1  # megatron numbers layers from 1, globally

    def global_expert(local_layer: int, local_expert: int) -> int:
        return int(layers[local_layer].mlp.local_expert_indices[local_expert])

    return [
        (name, param, rule_for(name, global_layer, tied=tied, value_head=value_head, global_expert=global_expert))
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
