"""The RL step's first stage: prompt batches in, rollout batches out.

:class:`Generation` draws each step's prompts from the loader, samples ``n`` responses to
each through the actor group's rollout (behind the hybrid switch) and annotates the rows
with what the rest of the step reads: the prompt's metadata (``prompt``, ``ground_truth``,
``data_meta``, the group id ``uid``) and the decoded ``response_text``.

:meth:`Generation.generate` is the seam for another kind of rollout (multi-turn episodes,
tools): it is the one place a :class:`~geartrain.data.PromptBatch` becomes a rollout batch,
for training, validation, greedy baselines and dynamic sampling alike.

On a placement whose ranks are other processes, :meth:`Generation.prefetch` sends the next
step's generation right behind the actor's update (``trainer.prefetch_generation``): the
ranks run it as soon as the update ends, from the same weights and with the same seeds as
if it were sent at the next step's start, while the driver finishes the step; the round
trip to the ranks leaves the step's critical path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from geartrain.batch import Batch
from geartrain.cluster import Dispatch, PendingCall, WorkerGroup
from geartrain.cluster.dispatch import prompt_batch
from geartrain.data import PromptBatch, PromptLoader
from geartrain.modeling import stop_token_ids
from geartrain.seeding import step_seed
from geartrain.stop_texts import cut_batch_at_stop_texts
from geartrain.trainer.config import TrainConfig
from geartrain.types import SamplingParams


def stop_rules(config: TrainConfig, tokenizer: Any) -> tuple[list[int], list[list[int]]]:
    """What ends a response: the token ids (EOS: the tokenizer's and each of the model's
    generation config, :func:`geartrain.modeling.stop_token_ids`) and the token sequences
    (``sampling.stop`` strings as the tokenizer encodes them: the contract's
    ``stop_sequences``; the text match is :mod:`geartrain.stop_texts`')."""
    sequences = [list(tokenizer.encode(text, add_special_tokens=False)) for text in config.sampling.stop]
    return stop_token_ids(config.model, tokenizer), sequences


@dataclass
class Prefetched:
    """A step's generation sent ahead (:meth:`Generation.prefetch`)."""

    step: int
    prompts: PromptBatch
    loader_state: dict[str, Any]
    """The loader's position before ``prompts`` were drawn."""
    call: PendingCall


class Generation:
    """Rollout batches for the RL steps, from ``loader``'s prompts and ``actor``'s rollout
    (a group with the hooks of :class:`geartrain.trainer.roles.ActorRolloutWorker`)."""

    def __init__(self, config: TrainConfig, actor: WorkerGroup, tokenizer: Any, loader: PromptLoader) -> None:
        self.config = config
        self.actor = actor
        self.tokenizer = tokenizer
        self.loader = loader
        self.stop_ids, self.stop_sequences = stop_rules(config, tokenizer)
        # async rollout: prompts of the steps generated ahead, with the loader's state
        # before each (a checkpoint must resume at the first step not trained yet)
        self.ahead: deque[tuple[PromptBatch, dict[str, Any]]] = deque()
        self.prefetched: Prefetched | None = None

    def loader_state(self) -> dict[str, Any]:
        """The data loader's position for a checkpoint: before the prompts of the first
        step not trained yet (async rollout and :meth:`prefetch` draw prompts ahead of
        training)."""
        if self.prefetched is not None:
            return self.prefetched.loader_state
        return self.ahead[0][1] if self.ahead else self.loader.state_dict()

    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` sends anything: ``trainer.prefetch_generation`` is on,
        the rollout is synchronous (no ``trainer.async_rollout``), the samples come from
        this class's own :meth:`generate` (not episodes, not separate replicas) and the
        actor group's submitted calls overlap the driver's work (``WorkerGroup.overlaps``)."""
        return (
            self.config.trainer.prefetch_generation
            and not self.config.trainer.async_rollout
            and type(self).generate is Generation.generate
            and self.actor.overlaps
        )

    def prefetch(self, step: int) -> None:
        """Send step ``step``'s generation now, behind the calls already sent to the actor
        group (its ranks run them first: the update whose weights it must sample from);
        :meth:`next` takes it. Its prompts are drawn now: until then :meth:`loader_state`
        is the position before them, so a checkpoint in between resumes at ``step``."""
        if self.prefetched is not None or not self.can_prefetch():
            return
        state = self.loader.state_dict()
        prompts = self.loader.next_batch()
        sampling = self.sampling(step)
        call = self.actor.submit("generate", prompt_batch(prompts.prompt_ids), sampling, dispatch=Dispatch.DP)
        self.prefetched = Prefetched(step, prompts, state, call)

    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        """Step ``step``'s sampling (``sampling.*``, seeded by the step); dynamic sampling's
        extra rounds ``round_ = 1, 2, ...`` get seeds of their own."""
        s = self.config.sampling
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            stop_token_ids=self.stop_ids,
            stop_sequences=self.stop_sequences,
            repetition_penalty=s.repetition_penalty,
            min_p=s.min_p,
            # round 0 keeps the seed it always had; dynamic sampling's extra rounds differ
            seed=step_seed(self.config.trainer.seed, step, salt=100 + round_ if round_ else 0),
        )

    def greedy(self, max_tokens: int | None = None) -> SamplingParams:
        """One greedy response per prompt (validation, ReMax's baseline)."""
        max_tokens = max_tokens or self.config.sampling.max_tokens
        return SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_ids,
            stop_sequences=self.stop_sequences,
            seed=0,
        )

    def generate(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """``sampling.n`` samples of each of ``prompts``, prompt-major, annotated; with the
        rollout's measurements (``timing/generate_s``, the hybrid switch's)."""
        # each data-parallel rollout replica generates its share of the prompts
        batch, metrics = self.actor.call("generate", prompt_batch(prompts.prompt_ids), sampling, dispatch=Dispatch.DP)
        return self.annotate(batch, prompts, sampling.n), metrics

    def next(self, step: int) -> tuple[PromptBatch, Batch, dict[str, float]]:
        """Step ``step``'s prompts and samples. Async rollout: keep generations queued for
        steps ``step .. step + max_staleness`` and take this step's (generated while
        earlier steps trained)."""
        if self.prefetched is not None:
            ahead, self.prefetched = self.prefetched, None
            if ahead.step != step:
                raise RuntimeError(f"the generation sent ahead is step {ahead.step}'s, not step {step}'s")
            batch, metrics = ahead.call.result()
            return ahead.prompts, self.annotate(batch, ahead.prompts, self.config.sampling.n), metrics
        if not self.config.trainer.async_rollout:
            prompts = self.loader.next_batch()
            return prompts, *self.generate(prompts, self.sampling(step))
        while len(self.ahead) <= self.config.trainer.max_staleness:
            state = self.loader.state_dict()
            prompts = self.loader.next_batch()
            self.actor.call("submit_generate", prompts.prompt_ids, self.sampling(step + len(self.ahead)))
            self.ahead.append((prompts, state))
        prompts, _ = self.ahead.popleft()
        batch, metrics = self.actor.call("take_generated")
        return prompts, self.annotate(batch, prompts, self.config.sampling.n), metrics

    def annotate(self, batch: Batch, prompts: PromptBatch, n: int) -> Batch:
        """Add the prompts' per-sample metadata and the decoded responses to ``batch``.
        With ``sampling.stop`` strings, each response is first cut at the first of them in
        its text, however the model's tokens spell it (:mod:`geartrain.stop_texts`; the
        rollout's own stop matches their tokenizer encoding only); per-sample meta
        ``stop_text_cut`` says which were."""
        for key, values in prompts.sample_meta(n).items():
            batch[key] = values
        if self.config.sampling.stop:
            batch["stop_text_cut"] = cut_batch_at_stop_texts(batch, self.tokenizer, self.config.sampling.stop)
        ids, mask = batch["input_ids"], batch["response_mask"].bool()
        batch["response_text"] = self.tokenizer.batch_decode(
            [ids[i][mask[i]].tolist() for i in range(len(batch))], skip_special_tokens=True
        )
        return batch
