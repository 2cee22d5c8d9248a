"""Applying FSDP2 to a transformers model and the engine's handle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from geartrain.config import EngineConfig, ModelConfig
from geartrain.errors import ConfigError
from geartrain.modeling import torch_dtype
from geartrain.optim import build_optimizer
from geartrain.types import EngineContext
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.optim.lr_scheduler import LambdaLR

from geartrain_fsdp.attention_kernels import AttentionKernel, choose_kernel
from geartrain_fsdp.mesh import Meshes, build_meshes
from geartrain_fsdp.modeling import TokenOutputs, decoder_layers
from geartrain_fsdp.options import FSDPOptions
from geartrain_fsdp.ulysses import ATTENTION_NAME


@dataclass(kw_only=True)
class FSDPModel:
    """The engine's handle (opaque to the core)."""

    module: TokenOutputs
    """FSDP root (or the plain module in a single non-distributed process)."""
    config: EngineConfig
    options: FSDPOptions
    ctx: EngineContext
    meshes: Meshes
    optimizer: torch.optim.Optimizer | None = None
    scheduler: LambdaLR | None = None
    offloaded: frozenset[str] = field(default_factory=frozenset)
    attention_kernel: AttentionKernel = "sdpa"
    """The packed attention's kernel, chosen once from ``options.attention`` and the device."""
    peft: Any = None
    """The ``PeftModel`` around ``hf`` when ``config.lora`` is set (its config; the adapters
    themselves live in ``hf``'s LoRA layers)."""
    base: str | None = None
    """LoRA: the base model as a checkpoint references it (path, or tiny family and seed)."""
    base_hash: str | None = None
    """LoRA: SHA-256 of the frozen base weights (:func:`geartrain_fsdp.lora.base_fingerprint`)."""
    base_synced: bool = False
    """LoRA adapter-only sync: the base weights went to the rollout once already."""

    @property
    def hf(self) -> nn.Module:
        return self.module.hf

    @property
    def value_head(self) -> bool:
        return self.module.value_head

    @property
    def device(self) -> torch.device:
        return self.meshes.device

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


def shard_model(
    hf: nn.Module,
    config: EngineConfig,
    options: FSDPOptions,
    ctx: EngineContext,
    *,
    value_head: bool,
    model_config: ModelConfig | None = None,
) -> FSDPModel:
    """Build the meshes, add LoRA adapters when ``config.lora`` (before sharding: FSDP
    shards them with their layer), wrap ``hf`` (``fully_shard`` per decoder layer, then
    the root), and create AdamW + LR scheduler over the trainable parameters (skipped when
    ``config.optim.lr == 0``). ``value_head``: ``hf`` is a value model
    (``ModelConfig.value_head``) whose outputs are ``values``."""
    meshes = build_meshes(
        config.parallel, ctx, options.hsdp_replicate, shard_one_rank=one_rank_mesh(config, options, ctx)
    )
    if config.parallel.sp > 1 and not options.remove_padding:
        raise ConfigError(
            [("options.remove_padding", "sequence parallel (parallel.sp > 1) needs remove_padding = true")]
        )
    try:
        kernel = choose_kernel(options.attention, meshes.device, torch_dtype(config.param_dtype))
    except ValueError as exc:
        raise ConfigError([("options.attention", str(exc))]) from None
    compiles = options.compiles(meshes.device)
    if compiles:
        from geartrain_fsdp.compiling import check_backend

        problem = check_backend(options.compile_backend, meshes.device)
        if problem is not None:
            raise ConfigError([("options.compile_backend", problem)])
    peft_model = base_hash = None
    if config.lora is not None:
        if value_head:
            raise ConfigError([("lora", "LoRA adapters are for the policy (a causal LM), not a value model")])
        peft_model, base_hash = _add_adapters(hf, config, meshes, ctx)
    if options.remove_padding:
        hf.config._attn_implementation = ATTENTION_NAME
    if config.gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.train()
    module = TokenOutputs(
        hf,
        value_head=value_head,
        chunk_tokens=options.logits_chunk_tokens,
        fused_head=options.fused_log_probs,
        compile_backend=options.compile_backend if compiles else None,
    )

    if meshes.distributed:
        broadcast = options.meta_init or _any_rank_on_meta(module, meshes)
        rank0_state = _take_rank0_state(module, meshes.ctx_group) if broadcast else None
        mp = None
        if config.param_dtype != "float32":
            mp = MixedPrecisionPolicy(
                param_dtype=torch_dtype(config.param_dtype), reduce_dtype=torch_dtype(options.reduce_dtype)
            )
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=meshes.device.type == "cuda") if options.cpu_offload else OffloadPolicy()
        )
        kwargs = dict(
            mesh=meshes.fsdp_mesh, reshard_after_forward=options.reshard_after_forward, offload_policy=offload
        )
        if mp is not None:
            kwargs["mp_policy"] = mp
        for layer in decoder_layers(hf):
            fully_shard(layer, **kwargs)
        fully_shard(module, **kwargs)
        if broadcast:
            _load_from_rank0(module, rank0_state, meshes, cpu_offload=options.cpu_offload)
        elif not options.cpu_offload:
            module.to(meshes.device)
    else:
        module.to(meshes.device)
    if compiles:
        from geartrain_fsdp.compiling import compile_decoder_layers

        # after sharding (FSDP2's hooks wrap the compiled forward and stay eager)
        compile_decoder_layers(hf, backend=options.compile_backend)

    handle = FSDPModel(
        module=module,
        config=config,
        options=options,
        ctx=ctx,
        meshes=meshes,
        attention_kernel=kernel,
    )
    if peft_model is not None:
        from geartrain_fsdp.lora import base_reference

        handle.peft = peft_model
        handle.base_hash = base_hash
        handle.base = base_reference(model_config) if model_config is not None else None
    if config.optim.lr > 0:
        handle.optimizer, handle.scheduler = build_optimizer(handle.params(), config.optim)
    return handle


def one_rank_mesh(config: EngineConfig, options: FSDPOptions, ctx: EngineContext) -> bool:
    """Whether a one-rank engine still shards over a one-rank mesh: for FSDP2's CPU offload,
    and for bf16/fp16 compute whenever the role has its process group (a training job's
    roles always do), so that FSDP2's ``MixedPrecisionPolicy`` runs the whole module in
    ``param_dtype`` (residual stream, norms, q/k into attention) over fp32 master weights.
    Without a group (an engine built in code) a one-rank bf16 engine falls back to autocast
    over the fp32 module."""
    if options.cpu_offload:
        return True
    return ctx.world_size == 1 and config.param_dtype != "float32" and ctx.process_group is not None


def _add_adapters(hf: nn.Module, config: EngineConfig, meshes: Meshes, ctx: EngineContext) -> tuple[Any, str]:
    """Inject the LoRA adapters (initialised from ``ctx.seed``, the same on every rank) and
    fingerprint the base; ranks built on the meta device take rank 0's fingerprint."""
    from geartrain_fsdp import lora

    assert config.lora is not None
    on_meta = any(p.is_meta for p in hf.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        peft_model = lora.wrap(hf, config.lora)
    fingerprint = None if on_meta else lora.base_fingerprint(hf)
    if meshes.distributed:
        box = [fingerprint]
        dist.broadcast_object_list(box, group=meshes.ctx_group, group_src=0)
        fingerprint = box[0]
    return peft_model, fingerprint


def _any_rank_on_meta(module: nn.Module, meshes: Meshes) -> bool:
    """True when some rank built its module on the meta device (``build_model`` does that
    on ranks > 0 for checkpoint models): rank 0's weights are then broadcast."""
    on_meta = torch.tensor([float(any(p.is_meta for p in module.parameters()))], device=meshes.device)
    dist.all_reduce(on_meta, op=dist.ReduceOp.MAX, group=meshes.ctx_group)
    return bool(on_meta.item())


def _take_rank0_state(
    module: TokenOutputs, group: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Rank 0's full weights and buffers (copies: the broadcast overwrites what it is
    given); then every rank's module is moved to the meta device before sharding."""
    state = None
    if dist.get_rank(group) == 0:
        state = (
            {k: v.detach().clone() for k, v in module.state_dict().items()},
            {k: b.detach().clone() for k, b in module.named_buffers()},
        )
    module.to_empty(device="meta")
    # moving to meta replaces parameters by new objects, which unties tied embeddings
    module.hf.tie_weights()
    return state


def _load_from_rank0(module: nn.Module, state: tuple | None, meshes: Meshes, *, cpu_offload: bool) -> None:
    """Fill every rank's (sharded, empty) module with the weights of the role's rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module.to_empty(device="cpu" if cpu_offload else meshes.device)
    weights = state[0] if state is not None else {}
    set_model_state_dict(
        module, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    # non-persistent buffers (rotary inv_freq...) are not in the state dict: broadcast them
    src = state[1] if state is not None else {}
    group = meshes.ctx_group
    for name, buf in module.named_buffers():
        if dist.get_rank(group) == 0:
            buf.copy_(src[name].to(buf.device))
        dist.broadcast(buf, group=group, group_src=0)
