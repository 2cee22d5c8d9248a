"""Write a small Llama model as a GGUF file, with the ``gguf`` package's own writer: the
tests' stand-in for a GGUF model from a package index (no download). The weights are
float32 (GGUF type F32), laid out and named as llama.cpp's converter writes them (q/k rows
permuted for its rotary layout), and the file carries a byte-level BPE tokenizer and a chat
template, so transformers reads model and tokenizer back from it alone.

Needs ``gguf`` (``pip install 'geartrain[gguf]'``).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "byte_tokens", "write_llama_gguf"]

#: a ChatML template (the one SmolLM2 carries, without its default system turn)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character for each of the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for a rotary projection of ``heads`` heads (transformers' GGUF
    reader undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model: torch.nn.Module, path: str | Path, *, name: str = "tiny-llama") -> Path:
    """Write ``model`` (a transformers ``LlamaForCausalLM`` whose vocabulary is
    ``len(SPECIAL_TOKENS) + 256`` plus merges' tokens, or larger: extra ids get filler
    tokens) to ``path`` as a GGUF file with the byte-level tokenizer of :func:`byte_tokens`
    (special tokens first: ``<|endoftext|>`` is BOS/EOS/PAD, ``<|im_end|>`` ends a turn)."""
    import gguf
    import numpy as np

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    writer.add_rope_freq_base(float(theta or 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = list(SPECIAL_TOKENS) + byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    tokens += [f"<|filler_{i}|>" for i in range(cfg.vocab_size - len(tokens))]
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size}) is smaller than the tokenizer's ({len(tokens)})")
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for layer in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            weight = state[f"model.layers.{layer}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                weight = _permute(weight, heads)
            elif hf == "self_attn.k_proj":
                weight = _permute(weight, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gg}.weight", np.ascontiguousarray(weight.numpy()))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
