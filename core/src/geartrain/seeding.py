"""Placement-invariant random streams for sampling.

Every sample draws its random numbers from its own stream, keyed by *what* it is — (run
seed, step) folded into :attr:`SamplingParams.seed <geartrain.types.SamplingParams.seed>`,
then the prompt's index in the step's batch and the sample's index among that prompt's
``n`` — never by *where* it is generated (which rank, which chunk, which row of a local
batch). So the same job samples the same tokens on one rank or on N, however the prompts
are split across data-parallel rollout replicas. Every rollout backend seeds its per-sample
generators with :func:`sample_seed`.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(run_seed: int, step: int, salt: int = 0) -> int:
    """The seed of one step's sampling (or, with another ``salt``, of its shuffling):
    a resumed run draws what the uninterrupted one would."""
    return (run_seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2**31 - 1)


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index`` (its index in the
    whole step's batch, not in a rank's share) under the request seed ``seed``.

    The result is in ``[0, 2**63)``: valid for ``torch.Generator.manual_seed`` and for
    the per-request seeds of vLLM and SGLang."""
    if prompt_index < 0 or sample_index < 0:
        raise ValueError(f"prompt_index and sample_index must be >= 0, got {prompt_index}, {sample_index}")
    value = _mix(seed & _MASK64)
    value = _mix(value ^ (prompt_index & _MASK64))
    value = _mix(value ^ ((sample_index + 0x5A5A) & _MASK64))
    return value >> 1


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors read as uint64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` on an int64 tensor read as uint64 (multiplication wraps mod 2**64)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def uniform(seed: int, counter: int) -> float:
    """The ``counter``-th uniform number in ``[0, 1)`` of the stream of ``seed`` (a
    :func:`sample_seed`): the reference for :func:`uniforms`."""
    value = _mix((seed & _MASK64) ^ _mix(counter & _MASK64))
    return (value >> 11) * 2.0**-53


def uniforms(seeds: torch.Tensor, counter: int | torch.Tensor) -> torch.Tensor:
    """``uniform(seeds[i], counter)`` for an int64 tensor of seeds, computed with tensor
    operations (no per-row generator): float64 in ``[0, 1)``, the same on every device and
    equal to :func:`uniform` bit for bit. A sample's ``t``-th token draws
    ``uniforms(seed, t)``, so its numbers do not depend on the rows it is batched with.

    ``counter`` may be a 0-d int64 tensor on the seeds' device (a decode step captured in a
    CUDA graph advances it in place): the numbers are the same as for the int."""
    if isinstance(counter, torch.Tensor):
        mixed_counter = _mix_tensor(counter.to(torch.int64))
    else:
        mixed_counter = _signed(_mix(counter & _MASK64))
    value = _mix_tensor(seeds.to(torch.int64) ^ mixed_counter)
    return _shift_right(value, 11).to(torch.float64) * 2.0**-53


def prompt_indices(sampling_indices: list[int] | None, num_prompts: int) -> list[int]:
    """The global index of each of ``num_prompts`` prompts: ``sampling_indices`` when the
    caller gave them (a data-parallel share), else ``0 .. num_prompts - 1``."""
    if sampling_indices is None:
        return list(range(num_prompts))
    if len(sampling_indices) != num_prompts:
        raise ValueError(f"SamplingParams.prompt_indices has {len(sampling_indices)} entries for {num_prompts} prompts")
    return list(sampling_indices)
