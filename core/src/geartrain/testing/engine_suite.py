"""The engine conformance suite.

A training-backend plugin proves it meets the hook contract by subclassing
:class:`EngineConformance` in its tests and naming itself::

    from geartrain.testing.engine_suite import EngineConformance

    class TestMyEngine(EngineConformance):
        backend = "my-engine"

Every test compares numbers against a plain transformers model built from the same
config: log-probs and entropy of a forward (and ``Σπ²`` for an engine that declares
``sum_pi_squared``), a training step against ``torch.optim.AdamW``,
micro-batching invariance, weight export names/shapes/values, checkpoint round trips, the HF
export, and error behaviour. Tests run on one rank in-process, or — with ``parallel = {"dp": 2}``
(any parallel sizes) — on that many Ray ranks behind the same interface, where they must give
the same numbers (:mod:`geartrain.testing.multirank`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager
from geartrain.cluster.process_group import acquire_single_rank_group
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.modeling import build_hf_model
from geartrain.testing.guard import StandardSuite
from geartrain.testing.reference import (
    make_batch,
    reference_token_outputs,
    reference_values,
    token_mean_nll_loss,
    token_valid_mask,
)
from geartrain.types import EngineContext, LossContext


class RecordingReceiver:
    """A :class:`~geartrain.rollout.WeightReceiver` that keeps what it is sent (a copy of
    each tensor) and notes how the stream was consumed."""

    def __init__(self, dtype: torch.dtype = torch.float32, bucket_bytes: int = 1 << 16) -> None:
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls = 0

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        for name, tensor in named_tensors:
            if name in self.tensors:
                raise AssertionError(f"tensor {name} sent twice in one sync")
            self.tensors[name] = tensor.detach().to("cpu", copy=True)


@functools.cache
def _suite_group() -> Any:
    return acquire_single_rank_group("cpu")


def _nll_and_sum_pi_squared(
    outputs: dict[str, torch.Tensor], micro_batch: Batch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """The NLL loss, reporting the sum of the ``sum_pi_squared`` it was given over the
    ``loss_mask`` tokens (summed over micro-batches and ranks: the step's total)."""
    share, metrics = token_mean_nll_loss(outputs, micro_batch, ctx)
    mask = micro_batch["loss_mask"].bool()
    return share, {**metrics, "sum_pi_squared": float(outputs["sum_pi_squared"].detach()[mask].sum())}


def _batch(seed: int = 0) -> Batch:
    # Ragged on both sides: left padding of different widths, responses of different lengths.
    return make_batch([5, 3, 7, 4], [6, 9, 2, 5], seed=seed)


class EngineConformance(StandardSuite):
    """Standard tests for an engine backend. Subclasses set ``backend`` (and may set
    ``options``, ``families`` and tolerances)."""

    _standard_suite = True
    contract_items: ClassVar[dict[str, tuple[str, str]]] = {
        "test_forward_log_probs_match_transformers": (
            "forward_backward(forward_only) returns per-token log_probs (and entropy when asked) equal to a plain "
            "transformers forward of the same config, aligned with input_ids, 0 where undefined (logprob_atol)",
            "the model you build (build_model from the ModelConfig), position_ids from the attention mask with left "
            "padding, the shift (log_probs[:, t] scores input_ids[:, t]), and the dtype you compute log-softmax in",
        ),
        "test_one_rank_consumes_the_whole_batch": (
            "data_parallel_coordinates: one data-parallel slice per dp rank; peers of sequence/tensor/pipeline "
            "parallelism share one",
            "data_parallel_coordinates' rank and size for this rank's mesh",
        ),
        "test_outputs_follow_the_batch_order": (
            "forward_backward returns its per-token outputs for the whole batch in the batch's row order",
            "micro-batching: plan_micro_batches groups rows that are not consecutive ([[0, 3], [1, 2]]), so put each "
            "micro-batch's outputs back at its rows' indices instead of concatenating the pieces",
        ),
        "test_training_matches_plain_adamw": (
            "forward_backward + optimizer_step train as plain PyTorch AdamW on the same model: the same losses, grad "
            "norms and weights (metric_atol, param_atol)",
            "backpropagating the share of the loss loss_fn returns (not a mean over micro-batches), the optimizer "
            "and schedule from geartrain.optim.build_optimizer, clipping with clipped_step",
        ),
        "test_micro_batching_does_not_change_the_step": (
            "the step is the same whatever max_tokens_per_micro_batch: micro-batching changes memory, not the update",
            "LossContext's global counts (the same in every micro-batch), gradients accumulated across micro-batches "
            "before optimizer_step, and the metrics summed over micro-batches",
        ),
        "test_loss_context_counts_are_global": (
            "every loss_fn call gets LossContext counts over the whole batch on all data-parallel ranks "
            "(global_tokens, global_sequences), micro_batch_index and num_micro_batches",
            "the counts: computed once from the whole batch's loss_mask before the first micro-batch, all-reduced "
            "over the data-parallel group",
        ),
        "test_non_finite_loss_skips_the_step": (
            "a step whose loss or gradients are not finite changes no weight and reports the skip",
            "optimizer_step: use geartrain.optim.clipped_step, which skips a non-finite step and reports it",
        ),
        "test_reported_lr_follows_the_schedule": (
            "optimizer_step reports the lr its update used, on geartrain.optim's schedule",
            "report the lr before scheduler.step() (clipped_step does), not the next step's",
        ),
        "test_weight_export_names_shapes_values": (
            "reshard_for_rollout sends every weight under its transformers name, shape and value",
            "the names (no FSDP/DDP/compile prefixes), tied weights sent once under the model's own name, "
            "full (unsharded) tensors",
        ),
        "test_weight_export_casts_to_the_rollout_dtype": (
            "reshard_for_rollout sends tensors in the receiver's dtype",
            "cast each tensor to the receiving rollout's dtype before sending (send_weights does)",
        ),
        "test_checkpoint_resume_reproduces_training": (
            "save_checkpoint + load_checkpoint continue training exactly as the uninterrupted run (resume_atol)",
            "that the checkpoint holds the optimizer state, the scheduler step and the RNG state, and load_checkpoint "
            "restores all of them",
        ),
        "test_saving_before_the_first_step_does_not_change_training": (
            "saving an engine that has not stepped does not touch its optimizer; resuming from it continues like a "
            "fresh engine",
            "save_checkpoint on a fresh optimizer (no state yet): do not create state to save it",
        ),
        "test_incomplete_checkpoint_is_refused": (
            "load_checkpoint refuses a directory that is not a complete checkpoint with CheckpointError",
            "check the completion marker (geartrain.checkpoint) before reading anything",
        ),
        "test_hf_export_loads_in_transformers": (
            "export_hf writes a directory AutoModelForCausalLM loads with the engine's weights",
            "config.json, the safetensors names (transformers names), tied weights once",
        ),
        "test_sum_pi_squared_matches_full_logits": (
            "an engine declaring sum_pi_squared returns Σ_v π(v)² per token when batch.info['need_sum_pi_squared'], "
            "equal to plain PyTorch over the full logits (sum_pi_squared_atol)",
            "the same logits as log_probs, exp(logsumexp(2 z) - 2 logsumexp(z)) per chunk, aligned like log_probs",
        ),
        "test_value_model_outputs_values": (
            "an engine declaring value_head returns per-token values for a value model (model_config.value_head)",
            "the value head's output aligned like log_probs, 0 where undefined",
        ),
        "test_offload_then_onload_keeps_training_identical": (
            "offload + onload leave training bit-identical",
            "that onload restores parameters, gradients and optimizer state in place (same tensors the optimizer "
            "holds)",
        ),
        "test_lora_trains_only_the_adapters": (
            "with LoRA only the adapters train; adapters off is the base model",
            "frozen base (requires_grad False, no optimizer state), batch.info['adapters_off'] disabling every adapter",
        ),
        "test_lora_adapter_sync_equals_merged_sync": (
            "sync='adapter' and sync='merged' serve the same policy; adapter sync moves only the adapter after the "
            "first",
            "adapters initialised identically from one config (seed from ctx.seed), the base sent once per engine "
            "(a flag on your model, not keyed by the rollout object) (docs/lora.md, For plugin authors)",
        ),
        "test_lora_checkpoint_round_trip": (
            "a LoRA checkpoint holds the adapters and their optimizer state only, and resumes exactly",
            "save only the adapter parameters and their optimizer state; load them onto the same base",
        ),
        "test_batch_without_input_ids_is_a_clear_error": (
            "a batch missing input_ids is an error that names it",
            "forward_backward's check of the batch's keys before computing",
        ),
    }

    backend: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    families: ClassVar[tuple[str, ...]] = ("qwen2", "llama")
    """Tiny model families every test runs on (see :meth:`model_config`)."""
    logprob_atol: ClassVar[float] = 1e-5
    """Per-token ``log_probs`` and ``values`` against a plain transformers forward (and
    against the engine itself: batch order, HF export)."""
    entropy_atol: ClassVar[float] = 1e-4
    """Per-token ``entropy`` against a plain transformers forward."""
    sum_pi_squared_atol: ClassVar[float] = 1e-5
    """Per-token ``sum_pi_squared`` (engines declaring it) against the full logits of a plain
    transformers forward."""
    metric_atol: ClassVar[float] = 1e-4
    """``loss`` and ``grad_norm`` against plain AdamW training, and between token budgets
    (micro-batching)."""
    param_atol: ClassVar[float] = 1e-4
    """Weights after training against plain AdamW, and between token budgets."""
    resume_atol: ClassVar[float] = 1e-6
    """Losses after a checkpoint round trip when ``checkpoint_bitwise`` is false."""
    lr_rtol: ClassVar[float] = 1e-9
    """The ``lr`` ``optimizer_step`` reports against the schedule's formula (relative)."""
    checkpoint_bitwise: ClassVar[bool] = True
    """Whether a checkpoint (saving, and resuming from it) must reproduce the following steps
    bit for bit."""
    #: Parallel sizes (``{"dp": 2}``, ``{"sp": 2}``, ``{"tp": 2, "pp": 2}``...): run every test
    #: on that many ranks through the ``ray`` placement (needs ``geartrain[ray]``); empty: one
    #: rank in this process. See :mod:`geartrain.testing.multirank`.
    parallel: ClassVar[dict[str, int]] = {}
    #: CPUs Ray reserves per rank in multi-rank mode (fractions let 4 ranks share 2 cores).
    multirank_cpus_per_rank: ClassVar[float] = 0.5
    _placement: ClassVar[Any] = None

    # ------------------------------------------------------------------ multi-rank mode
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _multirank_placement(cls) -> Iterator[None]:
        # a classmethod: pytest 10 drops class-scoped fixtures defined as instance methods
        if not cls.parallel:
            yield
            return
        from geartrain.testing.multirank import start_placement

        cls._placement = start_placement(ParallelConfig(**cls.parallel).world_size, cls.multirank_cpus_per_rank)
        try:
            yield
        finally:
            cls._placement.close()
            cls._placement = None

    @pytest.fixture(autouse=True)
    def _multirank_engines(self) -> Iterator[None]:
        self._ranked: list[Any] = []
        yield
        for engine in self._ranked:
            engine.close()

    # ------------------------------------------------------------------ helpers
    def engine_config(self, **overrides: Any) -> EngineConfig:
        fields: dict[str, Any] = dict(
            backend=self.backend,
            options=dict(self.options),
            optim=OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0),
        )
        fields.update(overrides)
        return EngineConfig(**fields)

    def model_config(self, family: str, **overrides: Any) -> ModelConfig:
        """The model every test of ``family`` builds (the engine under test and, from the
        engine's own ``model_config``, the transformers reference it is compared with).
        Override this, not the tests, to test another model; ``overrides`` are
        :class:`~geartrain.config.ModelConfig` fields (``value_head=True``...)."""
        return ModelConfig(tiny=family, seed=overrides.pop("seed", 3), **overrides)

    def make_engine(
        self, family: str, *, role: str = "actor", model: ModelConfig | None = None, **engine_overrides: Any
    ) -> Engine:
        """An engine on one rank, with the context the inline placement gives a role: a
        process group of size 1 (shared by the suite's engines, kept for the process)."""
        if self.parallel:
            from geartrain.testing.multirank import RankedEngine

            config = self.engine_config(parallel=ParallelConfig(**self.parallel), **engine_overrides)
            ranked = RankedEngine(type(self)._placement, config, model or self.model_config(family), role)
            self._ranked.append(ranked)
            return ranked  # type: ignore[return-value]
        ctx = EngineContext(role=role, seed=0, process_group=_suite_group())
        return Engine(self.engine_config(**engine_overrides), model or self.model_config(family), ctx)

    @staticmethod
    def full_weights(engine: Engine) -> dict[str, torch.Tensor]:
        receiver = RecordingReceiver()
        engine.sync_weights(receiver)
        return receiver.tensors

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Run each test once per model family in ``families``."""
        if "family" in metafunc.fixturenames:
            metafunc.parametrize("family", self.families)
        if "lora_family" in metafunc.fixturenames:  # LoRA is the same code on every family: one is enough
            metafunc.parametrize("lora_family", self.families[:1])

    # ------------------------------------------------------------------ forward
    def test_forward_log_probs_match_transformers(self, family: str) -> None:
        engine = self.make_engine(family)
        batch = _batch()
        out = engine.compute_log_probs(batch, entropy=True)
        ref = reference_token_outputs(build_hf_model(engine.model_config), batch)
        valid = token_valid_mask(batch["attention_mask"])
        assert out.outputs["log_probs"].shape == batch["input_ids"].shape
        torch.testing.assert_close(
            out.outputs["log_probs"][valid], ref["log_probs"][valid], atol=self.logprob_atol, rtol=0
        )
        torch.testing.assert_close(out.outputs["entropy"][valid], ref["entropy"][valid], atol=self.entropy_atol, rtol=0)
        assert torch.all(out.outputs["log_probs"][~valid] == 0), (
            "undefined positions (padding, first tokens) must hold 0"
        )

    def test_one_rank_consumes_the_whole_batch(self, family: str) -> None:
        """One data-parallel slice per ``dp`` rank (sequence/tensor/pipeline peers share one)."""
        engine = self.make_engine(family)
        assert (engine.dp.rank, engine.dp.size) == (0, self.parallel.get("dp", 1))

    def test_outputs_follow_the_batch_order(self, family: str) -> None:
        engine = self.make_engine(family, max_tokens_per_micro_batch=16)
        batch = _batch(seed=1)
        order = [2, 0, 3, 1]
        straight = engine.compute_log_probs(batch).outputs["log_probs"]
        shuffled = engine.compute_log_probs(batch.index(order)).outputs["log_probs"]
        torch.testing.assert_close(shuffled, straight[order], atol=self.logprob_atol, rtol=0)

    # ------------------------------------------------------------------ training
    def _reference_training(
        self, model_config: ModelConfig, steps: int, optim: OptimConfig
    ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
        model = build_hf_model(model_config).train()
        opt = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        losses, norms = [], []
        for step in range(steps):
            batch = _batch(seed=10 + step)
            mask = batch["loss_mask"].float()
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
            loss = -(logp * mask[:, 1:]).sum() / mask.sum()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}

    def _engine_training(self, engine: Engine, steps: int, first_seed: int = 10) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for step in range(steps):
            out = engine.forward_backward(_batch(seed=first_seed + step), token_mean_nll_loss)
            stats = engine.optimizer_step()
            losses.append(out.metrics["loss"])
            norms.append(stats["grad_norm"])
        return losses, norms

    def test_training_matches_plain_adamw(self, family: str) -> None:
        engine = self.make_engine(family)
        losses, norms = self._engine_training(engine, 3)
        ref_losses, ref_norms, ref_params = self._reference_training(engine.model_config, 3, engine.config.optim)
        assert losses == pytest.approx(ref_losses, abs=self.metric_atol)
        assert norms == pytest.approx(ref_norms, abs=self.metric_atol)
        weights = self.full_weights(engine)
        for name, tensor in weights.items():
            torch.testing.assert_close(
                tensor, ref_params[name], atol=self.param_atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )

    def test_micro_batching_does_not_change_the_step(self, family: str) -> None:
        big = self.make_engine(family, max_tokens_per_micro_batch=4096)
        small = self.make_engine(family, max_tokens_per_micro_batch=12)
        out_big = big.forward_backward(_batch(seed=5), token_mean_nll_loss)
        out_small = small.forward_backward(_batch(seed=5), token_mean_nll_loss)
        assert out_small.metrics["loss"] == pytest.approx(out_big.metrics["loss"], abs=self.metric_atol)
        stats_big, stats_small = big.optimizer_step(), small.optimizer_step()
        assert stats_small["grad_norm"] == pytest.approx(stats_big["grad_norm"], abs=self.metric_atol)
        w_big, w_small = self.full_weights(big), self.full_weights(small)
        for name in w_big:
            torch.testing.assert_close(w_small[name], w_big[name], atol=self.param_atol, rtol=0)

    def test_loss_context_counts_are_global(self, family: str) -> None:
        engine = self.make_engine(family, max_tokens_per_micro_batch=12)
        batch = _batch(seed=6)

        # Reported through the metrics (summed over micro-batches and ranks), so the check
        # holds where loss_fn runs on other ranks: the sums equal calls x the global counts
        # only if every call saw the global counts.
        def recording_loss(
            outputs: dict[str, torch.Tensor], micro: Batch, ctx: LossContext
        ) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = token_mean_nll_loss(outputs, micro, ctx)
            return loss, {
                **metrics,
                "calls": 1.0,
                "seen_tokens": float(ctx.global_tokens),
                "seen_sequences": float(ctx.global_sequences),
            }

        metrics = engine.forward_backward(batch, recording_loss).metrics
        engine.optimizer_step()
        assert metrics.get("calls", 0) >= 1, "loss_fn was never called"
        assert metrics["seen_tokens"] == metrics["calls"] * int(batch["loss_mask"].sum())
        assert metrics["seen_sequences"] == metrics["calls"] * len(batch)

    def test_non_finite_loss_skips_the_step(self, family: str) -> None:
        engine = self.make_engine(family)
        before = self.full_weights(engine)

        def nan_loss(
            outputs: dict[str, torch.Tensor], micro: Batch, ctx: LossContext
        ) -> tuple[torch.Tensor, dict[str, float]]:
            share, metrics = token_mean_nll_loss(outputs, micro, ctx)
            return share * float("nan"), metrics

        engine.forward_backward(_batch(), nan_loss)
        stats = engine.optimizer_step()
        assert stats["skipped"] == 1.0
        assert not math.isfinite(stats["grad_norm"])
        after = self.full_weights(engine)
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} changed on a skipped step"
        # and the next good step trains normally
        engine.forward_backward(_batch(), token_mean_nll_loss)
        assert engine.optimizer_step()["skipped"] == 0.0

    def test_reported_lr_follows_the_schedule(self) -> None:
        """``optimizer_step`` reports the lr its update used, on the schedule
        :mod:`geartrain.optim` states (``geartrain.optim.clipped_step`` does this)."""
        optim = OptimConfig(
            lr=1e-3, weight_decay=0.0, warmup_steps=2, lr_schedule="linear", total_steps=4, min_lr_ratio=0.5
        )
        engine = self.make_engine(self.families[0], optim=optim)
        lrs = []
        for step in range(5):
            engine.forward_backward(_batch(seed=40 + step), token_mean_nll_loss)
            lrs.append(engine.optimizer_step()["lr"])
        # by hand: warmup 1/2, 2/2 of lr; then 0.5 + 0.5 * (1 - p) with p = 0, 1/2, 1
        assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4], rel=self.lr_rtol)

    # ------------------------------------------------------------------ weights out
    def test_weight_export_names_shapes_values(self, family: str) -> None:
        engine = self.make_engine(family)
        reference = build_hf_model(engine.model_config).state_dict()
        receiver = RecordingReceiver(bucket_bytes=1 << 14)
        stats = engine.sync_weights(receiver)
        assert receiver.calls == 1
        names = set(receiver.tensors)
        untied = {n for n in reference if not _is_tied_duplicate(n, reference)}
        assert untied <= names <= set(reference), f"unexpected names {sorted(names ^ untied)[:5]}"
        for name, tensor in receiver.tensors.items():
            assert tensor.shape == reference[name].shape, name
            assert tensor.dtype == receiver.dtype, name
            assert torch.equal(tensor, reference[name]), name
        assert stats.num_tensors == len(names)
        # each distinct tensor counted once: a tied output layer sent under its own name too
        # is the embedding again (materialised once, in the embedding's bucket)
        distinct = {n: t for n, t in receiver.tensors.items() if not _is_tied_duplicate(n, reference)}
        assert stats.bytes == sum(t.numel() * t.element_size() for t in distinct.values())
        largest = max(t.numel() * t.element_size() for t in receiver.tensors.values())
        assert stats.max_bucket_bytes <= max(receiver.bucket_bytes, largest)
        assert stats.num_buckets > 1, "a bucket bound smaller than the model must give several buckets"

    def test_weight_export_casts_to_the_rollout_dtype(self, family: str) -> None:
        engine = self.make_engine(family)
        receiver = RecordingReceiver(dtype=torch.bfloat16)
        engine.sync_weights(receiver)
        reference = build_hf_model(engine.model_config).state_dict()
        for name, tensor in receiver.tensors.items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name

    # ------------------------------------------------------------------ checkpoints
    def test_checkpoint_resume_reproduces_training(self, family: str, tmp_path: Path) -> None:
        manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
        straight = self.make_engine(family)
        self._engine_training(straight, 1)
        straight.save_checkpoint(manager, 1, {"dataloader": {"index": 7}})
        losses_straight, _ = self._engine_training(straight, 2, first_seed=20)

        resumed = self.make_engine(family)
        extra = resumed.load_checkpoint(manager.latest())
        assert extra["dataloader"] == {"index": 7}
        losses_resumed, _ = self._engine_training(resumed, 2, first_seed=20)
        w_straight, w_resumed = self.full_weights(straight), self.full_weights(resumed)
        if self.checkpoint_bitwise:
            assert losses_resumed == losses_straight
            for name in w_straight:
                assert torch.equal(w_straight[name], w_resumed[name]), name
        else:
            assert losses_resumed == pytest.approx(losses_straight, abs=self.resume_atol)

    def test_saving_before_the_first_step_does_not_change_training(self, family: str, tmp_path: Path) -> None:
        """A job with checkpoints trains exactly like one without: saving an engine that has
        not stepped yet (the trainer saves before step 1) must not touch its optimizer, and
        resuming from that checkpoint continues like a fresh engine."""
        manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
        plain, saved = self.make_engine(family), self.make_engine(family)
        saved.save_checkpoint(manager, 0, {})
        losses_plain, norms_plain = self._engine_training(plain, 2)
        losses_saved, norms_saved = self._engine_training(saved, 2)
        resumed = self.make_engine(family)
        resumed.load_checkpoint(manager.latest())
        losses_resumed, norms_resumed = self._engine_training(resumed, 2)
        w_plain = self.full_weights(plain)
        for other, losses, norms in ((saved, losses_saved, norms_saved), (resumed, losses_resumed, norms_resumed)):
            w_other = self.full_weights(other)
            if self.checkpoint_bitwise:
                assert (losses, norms) == (losses_plain, norms_plain)
                for name in w_plain:
                    assert torch.equal(w_plain[name], w_other[name]), name
            else:
                assert losses == pytest.approx(losses_plain, abs=self.resume_atol)

    def test_incomplete_checkpoint_is_refused(self, family: str, tmp_path: Path) -> None:
        from geartrain.errors import CheckpointError

        engine = self.make_engine(family)
        (tmp_path / "step_00000001").mkdir()
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            engine.load_checkpoint(tmp_path / "step_00000001")

    def test_hf_export_loads_in_transformers(self, family: str, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        from geartrain.modeling import tiny_tokenizer

        engine = self.make_engine(family)
        self._engine_training(engine, 1)
        engine.export_hf(tmp_path / "hf", tokenizer=tiny_tokenizer())
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        batch = _batch(seed=9)
        ours = engine.compute_log_probs(batch).outputs["log_probs"]
        theirs = reference_token_outputs(loaded, batch)["log_probs"]
        torch.testing.assert_close(ours, theirs, atol=self.logprob_atol, rtol=0)
        assert (tmp_path / "hf" / "tokenizer_config.json").exists() or (tmp_path / "hf" / "tokenizer.json").exists()

    # ------------------------------------------------------------------ optional capabilities
    def test_sum_pi_squared_matches_full_logits(self, family: str) -> None:
        """An engine that declares ``sum_pi_squared`` returns ``Σ_v π(v)²`` per token when
        asked, in a forward and to the loss of a training step (in micro-batches), equal to
        plain PyTorch over the full logits; it is absent when not asked for."""
        engine = self.make_engine(family, max_tokens_per_micro_batch=16)
        if "sum_pi_squared" not in engine.info.capabilities:
            pytest.skip(f"engine '{self.backend}' does not declare sum_pi_squared")
        batch = _batch(seed=6)
        valid = token_valid_mask(batch["attention_mask"])
        ref = reference_token_outputs(build_hf_model(engine.model_config), batch)["sum_pi_squared"]
        out = engine.compute_log_probs(batch, sum_pi_squared=True).outputs
        assert out["sum_pi_squared"].shape == batch["input_ids"].shape
        assert out["sum_pi_squared"].dtype == torch.float32
        torch.testing.assert_close(out["sum_pi_squared"][valid], ref[valid], atol=self.sum_pi_squared_atol, rtol=0)
        assert torch.all(out["sum_pi_squared"][~valid] == 0)
        assert "sum_pi_squared" not in engine.compute_log_probs(batch).outputs
        batch.info["need_sum_pi_squared"] = True  # a training step's loss reads it (micro-batched)
        step = engine.forward_backward(batch, _nll_and_sum_pi_squared)
        assert step.metrics["micro_batches"] > self.parallel.get("dp", 1)
        mask = batch["loss_mask"].bool()
        want = float(ref[mask].sum())
        assert step.metrics["sum_pi_squared"] == pytest.approx(want, abs=self.sum_pi_squared_atol * int(mask.sum()))
        torch.testing.assert_close(
            step.outputs["sum_pi_squared"][valid], ref[valid], atol=self.sum_pi_squared_atol, rtol=0
        )

    def test_value_model_outputs_values(self, family: str) -> None:
        engine_probe = self.make_engine(family)
        if "value_head" not in engine_probe.info.capabilities:
            pytest.skip(f"engine '{self.backend}' does not declare value_head")
        model = self.model_config(family, value_head=True)
        engine = self.make_engine(family, role="critic", model=model)
        batch = _batch(seed=4)
        out = engine.forward_backward(batch, None, forward_only=True)
        ref = reference_values(build_hf_model(engine.model_config), batch)
        valid = token_valid_mask(batch["attention_mask"])
        torch.testing.assert_close(out.outputs["values"][valid], ref[valid], atol=self.logprob_atol, rtol=0)

    def test_offload_then_onload_keeps_training_identical(self, family: str) -> None:
        plain = self.make_engine(family)
        if "offload" not in plain.info.capabilities:
            pytest.skip(f"engine '{self.backend}' does not declare offload")
        moved = self.make_engine(family)
        self._engine_training(plain, 1)
        self._engine_training(moved, 1)
        off = moved.offload()
        on = moved.onload()
        assert off.seconds >= 0 and on.seconds >= 0
        losses_plain, _ = self._engine_training(plain, 1, first_seed=30)
        losses_moved, _ = self._engine_training(moved, 1, first_seed=30)
        assert losses_moved == losses_plain
        w_plain, w_moved = self.full_weights(plain), self.full_weights(moved)
        for name in w_plain:
            assert torch.equal(w_plain[name], w_moved[name]), name

    # ------------------------------------------------------------------ LoRA (engines declaring 'lora')
    lora_rank: ClassVar[int] = 4
    """Rank of the adapters the LoRA tests train (they run on the first of ``families``)."""

    def make_lora_engine(self, lora_family: str, sync: str = "merged", **engine_overrides: Any) -> Engine:
        """An engine training LoRA adapters (skips the test where the engine has no ``lora``)."""
        from geartrain import plugins

        if "lora" not in plugins.backend_info("engine", self.backend).capabilities:
            pytest.skip(f"engine '{self.backend}' does not declare lora")
        lora = LoraConfig(rank=self.lora_rank, alpha=2.0 * self.lora_rank, sync=sync)  # type: ignore[arg-type]
        optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
        return self.make_engine(lora_family, lora=lora, **{"optim": optim, **engine_overrides})

    def test_lora_trains_only_the_adapters(self, lora_family: str) -> None:
        """After LoRA steps (weight decay on): every weight that has no adapter is the base's
        bit for bit, the forward with adapters off equals the base model's, and the adapted
        model (merged sync) moved away from it."""
        engine = self.make_lora_engine(lora_family)
        self._engine_training(engine, 3)
        base = build_hf_model(engine.model_config)
        merged = self.full_weights(engine)
        reference = base.state_dict()
        changed = [name for name, t in merged.items() if not torch.equal(t, reference[name])]
        assert changed, "three LoRA steps changed no weight"
        assert all(name.endswith(".weight") and "embed" not in name and "norm" not in name for name in changed), changed
        batch = _batch(seed=2)
        off = engine.compute_log_probs(batch, adapters_off=True).outputs["log_probs"]
        on = engine.compute_log_probs(batch).outputs["log_probs"]
        ref = reference_token_outputs(base, batch)["log_probs"]
        valid = token_valid_mask(batch["attention_mask"])
        torch.testing.assert_close(off[valid], ref[valid], atol=self.logprob_atol, rtol=0)
        assert (on[valid] - ref[valid]).abs().max() > 100 * self.logprob_atol

    def test_lora_adapter_sync_equals_merged_sync(self, lora_family: str) -> None:
        """The same training synced both ways into the reference torch rollout: the same
        samples, log-probs equal to the engine's (1e-5), and the adapter-only sync moves only
        the adapter after the first one."""
        from geartrain.config import RolloutConfig
        from geartrain.rollout import Rollout
        from geartrain.types import SamplingParams

        outs, stats = [], []
        for sync in ("merged", "adapter"):
            engine = self.make_lora_engine(lora_family, sync=sync)
            self._engine_training(engine, 2)
            rollout = Rollout(
                RolloutConfig(backend="torch", max_lora_rank=self.lora_rank),
                engine.model_config,
                EngineContext(role="rollout"),
            )
            first = engine.sync_weights(rollout)
            self._engine_training(engine, 1, first_seed=30)
            stats.append((first, engine.sync_weights(rollout)))
            sampled = rollout.generate(
                [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63]], SamplingParams(n=2, max_tokens=8, seed=5)
            )
            mine = engine.compute_log_probs(sampled).outputs["log_probs"]
            mask = sampled["response_mask"].bool()
            torch.testing.assert_close(mine[mask], sampled["rollout_log_probs"][mask], atol=self.logprob_atol, rtol=0)
            outs.append(sampled)
        assert torch.equal(outs[0]["input_ids"], outs[1]["input_ids"])
        (merged_first, merged_next), (adapter_first, adapter_next) = stats
        assert merged_next.bytes == merged_first.bytes
        assert adapter_next.bytes < adapter_first.bytes and adapter_next.bytes < merged_next.bytes / 2

    def test_lora_checkpoint_round_trip(self, lora_family: str, tmp_path: Path) -> None:
        """Resuming LoRA training from a checkpoint continues as the uninterrupted run, and
        the checkpoint holds the adapters (+ their optimizer state), a fraction of a full one."""
        lora_manager = CheckpointManager(tmp_path / "lora", keep_last=1)
        straight = self.make_lora_engine(lora_family)
        self._engine_training(straight, 1)
        saved = straight.save_checkpoint(lora_manager, 1, {"k": 1})
        losses_straight, _ = self._engine_training(straight, 2, first_seed=20)
        resumed = self.make_lora_engine(lora_family)
        assert resumed.load_checkpoint(saved) == {"k": 1}
        losses_resumed, _ = self._engine_training(resumed, 2, first_seed=20)
        assert losses_resumed == pytest.approx(losses_straight, abs=self.resume_atol)
        full = self.make_engine(lora_family)
        self._engine_training(full, 1)
        full_saved = full.save_checkpoint(CheckpointManager(tmp_path / "full", keep_last=1), 1, {"k": 1})
        assert _dir_bytes(saved) < 0.5 * _dir_bytes(full_saved), (_dir_bytes(saved), _dir_bytes(full_saved))

    # ------------------------------------------------------------------ errors
    def test_batch_without_input_ids_is_a_clear_error(self, family: str) -> None:
        engine = self.make_engine(family)
        batch = _batch()
        broken = Batch({"attention_mask": batch["attention_mask"], "loss_mask": batch["loss_mask"]})
        with pytest.raises(Exception, match="input_ids"):
            engine.forward_backward(broken, token_mean_nll_loss)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _is_tied_duplicate(name: str, state: dict[str, torch.Tensor]) -> bool:
    """``lm_head.weight`` when it is the embedding itself (tied embeddings)."""
    if name != "lm_head.weight":
        return False
    emb = state.get("model.embed_tokens.weight")
    return emb is not None and emb.data_ptr() == state[name].data_ptr()
