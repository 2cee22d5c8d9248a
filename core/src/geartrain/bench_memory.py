"""``geartrain bench memory``: peak memory of each phase of a GRPO step, and the largest
model preset that trains on this device with and without offload / gradient checkpointing.

One step is run for real on the chosen model (a :mod:`geartrain.presets` preset or the tiny
model) with the fsdp engine on a one-rank process group (so FSDP2 and its mixed-precision
and CPU-offload policies apply, as in a GPU job) and the torch rollout:

* ``rollout``: the rollout's weights plus its KV cache while it generates ``rows`` responses;
* ``old_log_probs``: a forward-only pass over the batch (the rollout released first, as a
  colocated job does);
* ``update``: forward + backward + AdamW step (fp32 master weights and optimizer state).

Peaks are measured as bytes above the process's state when the tool starts: on CUDA the
allocator's peak (``torch.cuda.max_memory_allocated``, reset per phase), on CPU the resident
set sampled every few milliseconds by a thread (coarser: it also sees the allocator's
caching). ``--largest`` tries each preset's update step, smallest first, in a child process
per try (an out-of-memory error kills only the child), and reports the largest that ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["PhasePeaks", "PeakMeter", "add_arguments", "largest_trainable", "measure", "run"]

PHASES = ("rollout", "old_log_probs", "update")
#: Sizes in the order ``--largest`` tries them.
CANDIDATES = ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b")


class PeakMeter:
    """Peak bytes in use on ``device`` above a baseline, per ``with meter.phase(name)``."""

    def __init__(self, device: str) -> None:

        self.device = device
        self.cuda = device.startswith("cuda")
        self.peaks: dict[str, int] = {}
        self.baseline = self._now()

    def _now(self) -> int:
        from geartrain.memory import current_memory_bytes

        return current_memory_bytes(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            peak = int(torch.cuda.max_memory_allocated())
        else:
            top = [self._now()]
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.002):
                    top[0] = max(top[0], self._now())

            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            try:
                yield
            finally:
                done.set()
                thread.join()
            peak = max(top[0], self._now())
        self.peaks[name] = max(0, peak - self.baseline)


@dataclass
class PhasePeaks:
    """What :func:`measure` reports (bytes above the baseline)."""

    model: str
    parameters: int
    device: str
    rows: int
    prompt_tokens: int
    response_tokens: int
    param_dtype: str
    cpu_offload: bool
    gradient_checkpointing: bool
    peaks: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        head = (
            f"{self.model} ({self.parameters / 1e6:.1f}M parameters) on {self.device}: {self.rows} rows of "
            f"{self.prompt_tokens}+{self.response_tokens} tokens, {self.param_dtype} compute, fp32 master weights "
            f"and AdamW state, cpu_offload={self.cpu_offload}, gradient_checkpointing={self.gradient_checkpointing}"
        )
        what = "allocator peak" if self.device.startswith("cuda") else "resident-set peak"
        rows = [
            f"  {name:<14} {self.peaks[name] / 2**30:8.3f} GiB  ({what} above start; {self.seconds[name]:.2f} s)"
            for name in PHASES
            if name in self.peaks
        ]
        return [head, *rows]


def _model_config(name: str, overrides: dict | None = None):  # noqa: ANN202 - ModelConfig
    from geartrain.config import ModelConfig

    extra = dict(config_overrides=overrides or {})
    return ModelConfig(tiny="qwen2", **extra) if name == "tiny" else ModelConfig(preset=name, **extra)


def measure(
    name: str,
    *,
    device: str,
    rows: int = 64,
    samples: int = 8,
    prompt_tokens: int = 256,
    response_tokens: int = 256,
    param_dtype: str | None = None,
    cpu_offload: bool = False,
    gradient_checkpointing: bool = False,
    micro_batch_tokens: int = 16384,
    phases: Sequence[str] = PHASES,
    config_overrides: dict | None = None,
) -> PhasePeaks:
    """One GRPO-shaped step on model ``name`` (``rows`` responses: ``rows / samples``
    prompts of ``prompt_tokens`` random tokens, ``samples`` responses of exactly
    ``response_tokens`` each), peak memory per phase. ``param_dtype`` defaults to
    ``bfloat16`` on CUDA and ``float32`` on CPU; ``config_overrides`` change the model's
    shape (``model.config_overrides``)."""
    import torch

    from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
    from geartrain.config import EngineConfig, OptimConfig, RolloutConfig
    from geartrain.engine import Engine
    from geartrain.rollout import Rollout
    from geartrain.testing.reference import token_mean_nll_loss
    from geartrain.types import EngineContext, SamplingParams

    if rows % samples:
        raise ValueError(f"rows ({rows}) must be a multiple of samples ({samples})")
    dtype = param_dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    meter = PeakMeter(device)
    group = acquire_single_rank_group(device)
    model = _model_config(name, config_overrides)
    engine = Engine(
        EngineConfig(
            backend="fsdp",
            param_dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            max_tokens_per_micro_batch=micro_batch_tokens,
            optim=OptimConfig(lr=1e-6),
            options={"cpu_offload": cpu_offload},
        ),
        model,
        EngineContext(role="actor", device=device, process_group=group),
    )
    report = PhasePeaks(
        model=name,
        parameters=sum(p.numel() for p in engine.handle.hf.parameters()),
        device=device,
        rows=rows,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        param_dtype=dtype,
        cpu_offload=cpu_offload,
        gradient_checkpointing=gradient_checkpointing,
    )
    vocab = engine.handle.hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, min(vocab, 100), (prompt_tokens,), generator=g).tolist() for _ in range(rows // samples)
    ]
    sampling = SamplingParams(n=samples, temperature=1.0, max_tokens=response_tokens, seed=0, stop_token_ids=[])

    def timed(phase: str):  # noqa: ANN202
        start = time.perf_counter()
        ctx = meter.phase(phase)

        @contextlib.contextmanager
        def both() -> Iterator[None]:
            with ctx:
                yield
            report.seconds[phase] = time.perf_counter() - start

        return both()

    rollout = None
    try:
        if "rollout" in phases:
            rollout = Rollout(
                RolloutConfig(
                    backend="torch",
                    dtype="bfloat16" if dtype == "bfloat16" else "float32",
                    max_model_len=prompt_tokens + response_tokens,
                    max_num_seqs=rows,
                    options={"static_cache": False},
                ),
                model,
                EngineContext(role="rollout", device=device, process_group=group),
            )
            engine.sync_weights(rollout)
            with timed("rollout"):
                batch = rollout.generate(prompts, sampling)
            rollout.release()
        else:
            from geartrain.layout import sequence_batch

            batch = sequence_batch(
                [p for p in prompts for _ in range(samples)],
                [torch.randint(4, 100, (response_tokens,), generator=g).tolist() for _ in range(rows)],
                0,
                mask_key="loss_mask",
            )
        if "loss_mask" not in batch.tensors:
            batch.tensors["loss_mask"] = batch["response_mask"]
        if "old_log_probs" in phases:
            with timed("old_log_probs"):
                engine.compute_log_probs(batch)
        if "update" in phases:
            with timed("update"):
                engine.forward_backward(batch, token_mean_nll_loss)
                engine.optimizer_step()
    finally:
        if rollout is not None:
            rollout.shutdown()
        release_single_rank_group(group)
    report.peaks = dict(meter.peaks)
    return report


def largest_trainable(
    candidates: Sequence[str],
    *,
    device: str,
    cpu_offload: bool,
    gradient_checkpointing: bool,
    timeout: float | None = None,
    **shape: int,
) -> tuple[str | None, dict[str, str]]:
    """The largest of ``candidates`` (smallest first) whose update step runs on ``device``,
    each tried in a child process; stops at the first that fails (or, with ``timeout``
    seconds for all tries, at the first still running when they are spent). Returns it
    (None: not even the first) and each tried candidate's outcome."""
    outcomes: dict[str, str] = {}
    best = None
    deadline = None if timeout is None else time.monotonic() + timeout
    for name in candidates:
        cmd = [
            sys.executable,
            "-m",
            "geartrain.bench_memory",
            name,
            "--device",
            device,
            "--phases",
            "update",
            "--json",
            *[f"--{k.replace('_', '-')}={v}" for k, v in shape.items()],
        ]
        if cpu_offload:
            cmd.append("--cpu-offload")
        if gradient_checkpointing:
            cmd.append("--gradient-checkpointing")
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            outcomes[name] = "not finished within the time given"
            break
        if proc.returncode == 0:
            peak = json.loads(proc.stdout.strip().splitlines()[-1])["peaks"]["update"]
            outcomes[name] = f"trains (update peak {peak / 2**30:.2f} GiB)"
            best = name
            continue
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        outcomes[name] = "out of memory" if "out of memory" in proc.stderr.lower() else f"failed: {tail[:160]}"
        break
    return best, outcomes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``geartrain bench memory``."""
    p.add_argument("model", help=f"a preset or 'tiny' ({', '.join(CANDIDATES)})")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--rows", type=int, default=64, help="responses in the step (prompts x samples)")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (GRPO's n)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="the engine's token budget per micro-batch")
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy (params, grads, AdamW state)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument(
        "--largest",
        action="store_true",
        help="also find the largest preset whose update step runs, with and without offload and "
        "gradient checkpointing (one child process per try)",
    )
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), help="models --largest tries, smallest first")
    p.add_argument("--json", action="store_true", help="print the measurement as one JSON line")


def argument_problem(args: argparse.Namespace, device: str) -> str | None:
    """What is wrong with ``geartrain bench memory``'s options for ``device`` (``None``:
    nothing), naming the option: the sizes are positive, ``--rows`` is a multiple of
    ``--samples``, and the device is ``cpu`` or a CUDA device this machine has."""
    for option in ("rows", "samples", "prompt_tokens", "response_tokens", "micro_batch_tokens"):
        value = getattr(args, option)
        if value < 1:
            return f"--{option.replace('_', '-')} must be at least 1 (got {value})"
    unknown = [name for name in getattr(args, "candidates", []) if name not in CANDIDATES]
    if unknown:
        return f"--candidates: unknown model(s) {', '.join(map(repr, unknown))}; choose from {', '.join(CANDIDATES)}"
    if args.rows % args.samples:
        return f"--rows ({args.rows}) must be a multiple of --samples ({args.samples}): rows are prompts x samples"
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return None
    if kind != "cuda" or (index and not index.isdigit()):
        return f"--device {device!r}: choose cpu or cuda (cuda:N for one GPU)"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"--device {device}: this machine has no CUDA device; use --device cpu"
    if index and int(index) >= count:
        return f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None


_SMALLER = "try fewer --rows, shorter --prompt-tokens/--response-tokens, or a smaller model"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def memory_problem(name: str, device: str) -> str | None:
    """Why ``name``'s update step cannot fit ``device`` = ``cpu`` before anything is
    allocated (``None``: it may): its fp32 weights, gradients and Adam's two moments alone
    (weights x 4, a lower bound) against this machine's memory and the process's address-space
    limit (``ulimit -v``). A model that cannot fit was attempted and ended in a page of
    allocation tracebacks, or the machine swapping."""
    if device != "cpu":
        return None
    from geartrain.modeling import build_hf_model
    from geartrain.trainer.preflight import address_space_left

    module = build_hf_model(_model_config(name), meta=True)
    need = 4 * sum(p.numel() for p in module.parameters()) * 4
    limits = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"))
    except (ValueError, OSError, AttributeError):
        pass
    if (left := address_space_left()) is not None:
        limits.append((left, "the address space this process may still map (ulimit -v)"))
    for have, what in limits:
        if need > have:
            return (
                f"{name}'s update step needs at least {need / 2**30:,.1f} GiB on cpu (fp32 weights, gradients and "
                f"Adam's two moments) and {what} is {have / 2**30:,.1f} GiB; choose a smaller model"
            )
    return None


def run(args: argparse.Namespace) -> int:
    """``geartrain bench memory``: measure, print, and with ``--largest`` search."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model not in CANDIDATES:
        print(f"error: unknown model {args.model!r}; choose from {', '.join(CANDIDATES)}", file=sys.stderr)
        return 2
    problem = argument_problem(args, device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    shape = dict(
        rows=args.rows,
        samples=args.samples,
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    problem = memory_problem(args.model, device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        report = measure(
            args.model,
            device=device,
            param_dtype=args.param_dtype,
            cpu_offload=args.cpu_offload,
            gradient_checkpointing=args.gradient_checkpointing,
            phases=args.phases,
            **shape,
        )
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if isinstance(exc, RuntimeError) and not any(w in str(exc) for w in ("allocate", "out of memory")):
            raise
        why = f"out of memory measuring {args.model} on {device} ({_first_line(exc)})"
        print(f"error: {why}; {_SMALLER}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(report)))
        return 0
    print("\n".join(report.lines()))
    if args.largest:
        total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
        where = f"{device}" + (f" ({total / 2**30:.0f} GiB)" if total else "")
        print(
            f"largest model whose update step ({args.rows} rows of {args.prompt_tokens}+{args.response_tokens}) "
            f"runs on {where}:"
        )
        for offload in (False, True):
            for ckpt in (False, True):
                best, outcomes = largest_trainable(
                    args.candidates, device=device, cpu_offload=offload, gradient_checkpointing=ckpt, **shape
                )
                tried = "; ".join(f"{k}: {v}" for k, v in outcomes.items())
                print(f"  cpu_offload={offload!s:<5} gradient_checkpointing={ckpt!s:<5} -> {best or 'none'}  ({tried})")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m geartrain.bench_memory", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
