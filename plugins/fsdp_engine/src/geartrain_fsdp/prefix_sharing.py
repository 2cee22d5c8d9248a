"""Shared-prompt packing: the ``n`` samples of one prompt run their prompt once.

A GRPO batch holds every prompt ``n`` times (one row per sample). Packed as plain
sequences, the prompt's tokens go through every layer ``n`` times, forward and backward,
though the causal model gives them the same hidden states each time. Here the rows of a
micro-batch whose prompt tokens are identical form one *segment*:

    [prompt | response 1 | response 2 | ... | response g]

with position ids ``0 .. p-1`` for the prompt and ``p .. p+q_k-1`` for each response (the
positions each token has in its own row), and an attention mask under which a prompt
token sees the prompt causally and a response token sees the whole prompt plus its own
response causally — never another sample's tokens. Every token thus gets exactly the
hidden state it has in its own row (up to float rounding: other matrix shapes), and the
prompt's gradient is the sum over its samples, as it is when each row carries its own copy.

Outputs are computed only where they are needed: the hidden state at packed position
``j`` gives the log-prob of the token that follows ``j`` in its row; the prompt's last
position is followed by each response's first token, so it serves ``g`` outputs. Outputs
for prompt tokens are computed once per segment and copied to each of its rows.

Used on one sequence-parallel rank only (sp = 1): the layout needs each segment whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(kw_only=True, slots=True)
class Segment:
    """One shared prompt and its responses inside the packed row."""

    start: int
    prefix: int
    responses: list[int]

    @property
    def length(self) -> int:
        return self.prefix + sum(self.responses)


@dataclass(kw_only=True, slots=True)
class SharedPacked:
    """A micro-batch in the shared-prompt layout.

    ``input_ids``/``position_ids`` ``[1, N]``; ``out_positions``/``out_targets`` ``[U]``: the
    packed position whose hidden state predicts each distinct output token, and that
    token; ``expand`` ``[M]`` picks, for each output slot of the ``[b, T]`` layout, its
    distinct output; ``dest`` ``[M]`` is that slot's flat index in ``[b, T]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: list[Segment]
    out_positions: torch.Tensor
    out_targets: torch.Tensor
    expand: torch.Tensor
    dest: torch.Tensor
    shape: tuple[int, int]
    attention: SegmentAttention | None = field(default=None)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> list[list[int]]:
    """Rows whose prompt (the real tokens left of column ``prompt_length``) is identical,
    in order of first appearance; each group lists its rows in increasing order."""
    key = torch.where(attention_mask[:, :prompt_length].bool(), input_ids[:, :prompt_length], -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def has_standard_layout(attention_mask: torch.Tensor, prompt_length: int) -> bool:
    """Every row is ``[left pad | prompt (>= 1 token) | response | right pad]`` with the
    response starting at column ``prompt_length``: the layout :mod:`geartrain.layout`
    builds, which the shared-prompt packing relies on."""
    b, t = attention_mask.shape
    if not 0 < prompt_length <= t or b == 0:
        return False
    mask = attention_mask.bool()
    cols = torch.arange(t)
    prompt = mask[:, :prompt_length].sum(1)
    response = mask[:, prompt_length:].sum(1)
    expected = (cols >= prompt_length - prompt[:, None]) & (cols < prompt_length + response[:, None])
    return bool((prompt > 0).all()) and bool((expected == mask).all())


def pack_shared(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    groups: list[list[int]] | None = None,
) -> SharedPacked:
    """Pack ``[b, T]`` rows in the standard layout (see :func:`has_standard_layout`) into
    one row of segments, one per group of rows with the same prompt (``groups``, as
    :func:`prompt_groups` returns them; computed when not given)."""
    b, t = input_ids.shape
    mask = attention_mask.bool()
    prompt_lens = mask[:, :prompt_length].sum(1).tolist()
    response_lens = mask[:, prompt_length:].sum(1).tolist()
    ids_rows = input_ids.tolist()

    tokens: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    out_positions: list[int] = []
    out_targets: list[int] = []
    expand: list[int] = []
    dest: list[int] = []
    if groups is None:
        groups = prompt_groups(input_ids, attention_mask, prompt_length)
    for rows in groups:
        first = rows[0]
        p = prompt_lens[first]
        prompt = ids_rows[first][prompt_length - p : prompt_length]
        start = len(tokens)
        tokens += prompt
        positions += range(p)
        # the prompt's own next-token outputs, once, copied to every row of the group
        prompt_outputs = len(out_positions)
        out_positions += range(start, start + p - 1)
        out_targets += prompt[1:]
        for row in rows:
            expand += range(prompt_outputs, prompt_outputs + p - 1)
            dest += range(row * t + prompt_length - p + 1, row * t + prompt_length)
        responses = []
        for row in rows:
            q = response_lens[row]
            response = ids_rows[row][prompt_length : prompt_length + q]
            block = len(tokens)
            tokens += response
            positions += range(p, p + q)
            if q:
                first_output = len(out_positions)
                out_positions.append(start + p - 1)
                out_positions += range(block, block + q - 1)
                out_targets += response
                expand += range(first_output, first_output + q)
                dest += range(row * t + prompt_length, row * t + prompt_length + q)
            responses.append(q)
        segments.append(Segment(start=start, prefix=p, responses=responses))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    return SharedPacked(
        input_ids=tensor(tokens).unsqueeze(0),
        position_ids=tensor(positions).unsqueeze(0),
        segments=segments,
        out_positions=tensor(out_positions),
        out_targets=tensor(out_targets),
        expand=tensor(expand),
        dest=tensor(dest),
        shape=(b, t),
    )


def scatter_outputs(values: torch.Tensor, packed: SharedPacked) -> torch.Tensor:
    """Distinct outputs ``[U]`` into the ``[b, T]`` layout (0 where no output belongs: each
    row's first token and padding). Differentiable in ``values``."""
    b, t = packed.shape
    expand = packed.expand.to(values.device)
    out = values.new_zeros(b * t)
    out = out.index_copy(0, packed.dest.to(values.device), values.index_select(0, expand))
    return out.view(b, t)


# --------------------------------------------------------------------------- attention
@dataclass(kw_only=True, slots=True)
class SegmentAttention:
    """Segments batched for attention: segments of similar length share one SDPA call,
    padded to the longest. ``index[i]`` ``[k, L]`` lists the packed positions of bucket
    ``i`` (padding points at the segment's first token), ``allowed[i]`` ``[k, 1, L, L]`` is
    its attention mask, ``order`` the valid positions bucket by bucket and ``inverse`` the
    permutation back to packed order."""

    index: list[torch.Tensor]
    allowed: list[torch.Tensor]
    valid: list[torch.Tensor]
    inverse: torch.Tensor

    @classmethod
    def build(cls, segments: list[Segment], device: torch.device, max_padding: float = 0.25) -> SegmentAttention:
        """Buckets of segments sorted by length; a bucket grows while its padded area stays
        within ``1 + max_padding`` times its real area."""
        ordered = sorted(segments, key=lambda s: s.length)
        buckets: list[list[Segment]] = []
        for seg in ordered:
            if buckets:
                bucket = buckets[-1]
                real = sum(s.length**2 for s in bucket) + seg.length**2
                if (len(bucket) + 1) * seg.length**2 <= (1 + max_padding) * real:
                    bucket.append(seg)
                    continue
            buckets.append([seg])
        index, allowed, valid, order = [], [], [], []
        for bucket in buckets:
            width = bucket[-1].length
            idx = torch.empty(len(bucket), width, dtype=torch.long)
            block = torch.full((len(bucket), width), -1, dtype=torch.long)  # -1: padding
            for k, seg in enumerate(bucket):
                idx[k] = seg.start
                idx[k, : seg.length] = torch.arange(seg.start, seg.start + seg.length)
                ids = [0] * seg.prefix
                for r, q in enumerate(seg.responses, start=1):
                    ids += [r] * q
                block[k, : seg.length] = torch.tensor(ids, dtype=torch.long)
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            same = (block[:, None, :] == 0) | (block[:, None, :] == block[:, :, None])
            mask = causal & same & (block[:, None, :] >= 0)
            # padding queries attend to the first token only (never an empty row: no NaN)
            pad_rows = block < 0
            mask[pad_rows] = False
            mask[..., 0] |= pad_rows
            real = block >= 0
            index.append(idx.to(device))
            allowed.append(mask.unsqueeze(1).to(device))
            flat_valid = real.flatten().nonzero().squeeze(1)
            valid.append(flat_valid.to(device))
            order.append(idx.flatten()[flat_valid])
        all_order = torch.cat(order)
        inverse = torch.empty_like(all_order)
        inverse[all_order] = torch.arange(len(all_order))
        return cls(index=index, allowed=allowed, valid=valid, inverse=inverse.to(device))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SegmentAttention, scaling: float | None
) -> torch.Tensor:
    """Attention of ``[1, H, N, d]`` tensors (``k``/``v`` may have fewer heads) under the
    shared-prompt mask; returns ``[1, H, N, d]``."""
    if k.shape[1] != q.shape[1]:  # GQA by repetition: SDPA's enable_gqa has no CPU kernel with a mask
        reps = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    outs = []
    for idx, allowed, valid in zip(layout.index, layout.allowed, layout.valid, strict=True):
        count, width = idx.shape

        def rows(x: torch.Tensor, idx: torch.Tensor = idx, count: int = count, width: int = width) -> torch.Tensor:
            return x[0].index_select(1, idx.flatten()).reshape(x.shape[1], count, width, x.shape[3]).transpose(0, 1)

        out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=allowed, scale=scaling)
        out = out.transpose(0, 1).reshape(q.shape[1], count * width, q.shape[3])
        outs.append(out.index_select(1, valid))
    return torch.cat(outs, dim=1).index_select(1, layout.inverse).unsqueeze(0)
