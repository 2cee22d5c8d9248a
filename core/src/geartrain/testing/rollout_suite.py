"""The rollout conformance suite: the standard tests every rollout backend passes.

A rollout plugin's tests subclass :class:`RolloutConformance` and say only how to build the
backend::

    from geartrain.testing import RolloutConformance

    class TestMyRollout(RolloutConformance):
        backend = "my-rollout"
        options = {"max_num_batched_tokens": 256}

Each standard test compares numbers with a reference computed here from a plain
transformers model (the tiny models of :mod:`geartrain.modeling`, fp32): teacher-forced
log-probs, a cache-free greedy decode, top-k / top-p supports. The suite talks to the
backend only through :class:`geartrain.Rollout`, so it holds for any backend.

The rollout is built once per class and model family (a class-scoped fixture), because
real engines take seconds to start. Tests that change its weights put the reference
weights back before they finish.

A subclass may replace a standard test only by listing it in ``overridden_tests`` with the
reason (``{"test_greedy_matches_reference": "bf16 only: ties flip"}``); overriding one
silently raises :class:`TypeError` when the class is created.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from geartrain.agents import Environment, EpisodeRunner, RunnerLimits, StepResult, episode_batch
from geartrain.batch import Batch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.errors import GeartrainError
from geartrain.layout import cut_at_stop
from geartrain.modeling import BOS, tiny_model, tiny_tokenizer
from geartrain.rollout import Rollout
from geartrain.testing.guard import StandardSuite
from geartrain.types import EngineContext, MemoryStats, SamplingParams

#: Prompts of different lengths, so batches are really left-padded.
PROMPT_TEXTS = ("Question: what is 2+2?", "hi", "The quick brown fox", "x = [1, 2,")


def encode_prompts(texts: tuple[str, ...] = PROMPT_TEXTS) -> list[list[int]]:
    """Token ids of ``texts`` under the tiny tokenizer, each starting with ``<s>``."""
    tok = tiny_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS)
    return [[bos, *tok.encode(text)] for text in texts]


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's weights as ``update_weights`` takes them, yielded one at a time."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach().clone()


def sequences(batch: Batch) -> list[torch.Tensor]:
    """Each row's real tokens (prompt then response), padding removed."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [ids[r][mask[r]] for r in range(len(batch))]


def responses(batch: Batch) -> list[list[int]]:
    """Each row's response tokens."""
    ids, mask = batch["input_ids"], batch["response_mask"].bool()
    return [ids[r][mask[r]].tolist() for r in range(len(batch))]


def response_log_probs(batch: Batch) -> list[list[float]]:
    """Each row's rollout log-probs of its response tokens."""
    lp, mask = batch["rollout_log_probs"], batch["response_mask"].bool()
    return [lp[r][mask[r]].tolist() for r in range(len(batch))]


@torch.no_grad()
def reference_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[L, V]`` (fp32) of a plain forward over one unpadded sequence."""
    return model(input_ids=tokens.unsqueeze(0)).logits[0].float()


def teacher_forced_log_probs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``log p(x_t | x_<t)`` of every response token under ``model``, laid out like
    ``rollout_log_probs`` (aligned to ``input_ids``, 0 elsewhere). The response mask may
    have gaps (a multi-turn episode's observations)."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    attention, response_mask = batch["attention_mask"].bool(), batch["response_mask"].bool()
    for r, seq in enumerate(sequences(batch)):
        lp = torch.log_softmax(reference_logits(model, seq), dim=-1)
        per_token = lp[:-1].gather(-1, seq[1:].unsqueeze(-1)).squeeze(-1)
        columns = attention[r].nonzero().squeeze(-1)[1:]
        row = torch.zeros(batch["input_ids"].shape[1], dtype=torch.float32)
        row[columns] = per_token
        out[r] = torch.where(response_mask[r], row, 0.0)
    return out


@torch.no_grad()
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()
) -> list[int]:
    """Greedy decode by full recomputation (no cache, no padding): the obvious reference."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(reference_logits(model, torch.tensor(seq)).argmax(-1)[-1])
        out.append(token)
        seq.append(token)
        if token in stop:
            break
    return out


class _CountdownEnvironment(Environment):
    """The multi-turn kit test's environment: a fixed observation after each model turn,
    done after the third."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: dict[str, Any]) -> str:
        return " go:"

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(observation=f" obs{self.turns}>", reward=float(self.turns), done=self.turns >= 3)


class RolloutConformance(StandardSuite):
    """Standard tests for a rollout backend; subclass and set ``backend``."""

    _standard_suite = True
    contract_items: ClassVar[dict[str, tuple[str, str]]] = {
        "test_batch_layout": (
            "generate returns len(prompts) * n rows, prompt-major, with input_ids, attention_mask, response_mask, "
            "rollout_log_probs, info['prompt_length'] and meta prompt_index / finish_reason",
            "build the batch with geartrain.layout.rollout_batch (one prompt per row, prompt_index, finish_reason, "
            "pad_token_id; docs/plugins.md, generate)",
        ),
        "test_logprobs_match_reference": (
            "rollout_log_probs are the model's own, unscaled log-probs of the sampled tokens, equal to a plain "
            "transformers forward (logprob_atol)",
            "log-probs taken before temperature / top-k / top-p, from the same weights and dtype, aligned with the "
            "response tokens",
        ),
        "test_greedy_matches_reference": (
            "temperature 0 is greedy: the argmax continuation of a plain transformers model, identical across samples",
            "temperature 0 handled as argmax (not a division by 0), position ids under left padding",
        ),
        "test_seed_reproducible": (
            "the same seed, prompts and weights give the same samples and log-probs",
            "sampling draws from geartrain.seeding's per-sample streams, not the global RNG",
        ),
        "test_different_seeds_differ": (
            "different seeds, and the samples of one prompt, differ",
            "that the seed (and the sample index j) reaches the sampler",
        ),
        "test_samples_do_not_depend_on_the_split": (
            "placement-invariant sampling: a sample's tokens depend on (seed, prompt_indices[i], j) only, not on the "
            "call it is in",
            "geartrain.seeding.sample_seed(seed, prompt_indices[i], j) per sample, with SamplingParams.prompt_indices",
        ),
        "test_max_tokens": (
            "a sample ends after max_tokens tokens with finish_reason 'length'",
            "the budget and the finish_reason of a sample its budget ended",
        ),
        "test_max_model_len_caps_generation": (
            "prompt + response never exceed max_model_len; a sample it cut has finish_reason 'length'",
            "each prompt's room (max_model_len - its length) as its budget",
        ),
        "test_stop_token_greedy": (
            "a stop token ends its sample, kept as its last token, finish_reason 'stop'",
            "stop_token_ids: keep the stop token, stop that row only",
        ),
        "test_stop_tokens_sampled": (
            "no sampled row goes on after a stop token",
            "stop_token_ids checked on every row of a sampled batch",
        ),
        "test_continuation_matches_one_shot": (
            "generating from prompt + the first k tokens continues as one call of k + m tokens (greedy)",
            "position ids and any prefix cache when a prompt is a previous call's output",
        ),
        "test_stop_sequences_greedy": (
            "multi-token stop sequences are matched in this call's tokens only, kept, finish_reason 'stop'",
            "geartrain.layout.native_stop_token_ids / stop_after_generation when the engine stops on single tokens",
        ),
        "test_stop_sequences_cut_the_same_samples": (
            "seeded samples with stop sequences are the samples without them, cut after the first match",
            "cut after the first match with the tokens and log-probs up to it (stop_after_generation)",
        ),
        "test_budget_per_prompt": (
            "max_tokens_per_prompt: each prompt's samples are its own budget long, or shorter when a stop ends them",
            "each prompt's budget from geartrain.layout.max_tokens_of(sampling), not sampling.max_tokens",
        ),
        "test_episode_logprobs_match_reference": (
            "three-turn episodes (EpisodeRunner): the row's rollout log-probs equal the teacher-forced log-probs",
            "continuation from token ids, stop sequences and per-prompt budgets together (the tests above)",
        ),
        "test_update_weights_resets_prefix_cache": (
            "a turn after update_weights is scored with the new weights only",
            "reset the prefix (KV) cache in update_weights",
        ),
        "test_top_k_restricts_support": (
            "top_k keeps the k most likely tokens",
            "the order: temperature, then top-k, then top-p of what is left",
        ),
        "test_top_p_restricts_support": (
            "top_p keeps the smallest nucleus of what top-k left",
            "the order: temperature, then top-k, then top-p of what top-k left",
        ),
        "test_sampling_frequencies_match_reference": (
            "sample frequencies follow softmax(top-k logits / temperature)",
            "temperature applied to the logits before top-k/top-p and sampling",
        ),
        "test_update_weights_and_sync_back": (
            "update_weights replaces the weights: samples follow the new model; syncing the old weights back "
            "reproduces the old samples",
            "that update_weights writes into the tensors generate reads (and resets caches)",
        ),
        "test_partial_update_keeps_other_tensors": (
            "an update of some tensors keeps the others (the tied input embedding updates the output layer too)",
            "apply only the named tensors; a tied weight under each of its names (geartrain.weights.with_aliases)",
        ),
        "test_release_resume_keeps_weights": (
            "release then resume serves the same weights (and returns MemoryStats)",
            "what release frees and resume restores (geartrain.weights.WeightCopy for a CPU engine)",
        ),
        "test_update_adapter_serves_base_plus_scaled_BA": (
            "update_adapter: samples follow W + alpha/r B A; a second adapter of the same name replaces the first; it "
            "survives release/resume",
            "the scale alpha / r from the adapter config, replacement (not stacking) under one name",
        ),
        "test_unknown_tensor_name_raises": (
            "update_weights refuses a tensor name the model does not have, naming it, and keeps its weights",
            "geartrain.weights.checked (UnknownTensorError) before applying anything",
        ),
        "test_prompt_longer_than_max_model_len_raises": (
            "a prompt with no room under max_model_len is refused, giving the limit, before generating",
            "geartrain.layout.check_generate_inputs at the start of generate",
        ),
    }

    backend: ClassVar[str] = ""
    """The rollout plugin name (``geartrain.rollouts`` entry point or registered name)."""
    options: ClassVar[dict[str, Any]] = {}
    """The backend's ``[rollout.options]``."""
    families: ClassVar[tuple[str, ...]] = ("qwen2", "llama")
    """Tiny model families the suite runs on (qwen2 ties its embeddings, llama does not)."""
    logprob_atol: ClassVar[float] = 1e-5
    """Tolerance of log-probs against the fp32 transformers reference."""
    max_model_len: ClassVar[int] = 64
    model_overrides: ClassVar[dict[str, dict[str, Any]]] = {}
    """Per family, transformers config fields changed in the tiny models (e.g. a head size
    a backend's kernels support); the reference models get the same."""
    rollout_extra: ClassVar[dict[str, Any]] = {}
    """Other :class:`~geartrain.config.RolloutConfig` fields (``kv_cache_bytes``...)."""
    # ------------------------------------------------------------------ fixtures

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "family" in metafunc.fixturenames:
            metafunc.parametrize("family", list(self.families), scope="class")

    @classmethod
    def rollout_config(cls) -> RolloutConfig:
        """The configuration the suite builds the backend with (a classmethod: the
        class-scoped fixtures call it)."""
        return RolloutConfig(
            backend=cls.backend, max_model_len=cls.max_model_len, options=dict(cls.options), **cls.rollout_extra
        )

    # Class-scoped fixtures are classmethods: pytest 10 drops instance-method ones (each
    # test gets a new instance while the fixture runs once per class).
    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, family: str) -> torch.nn.Module:
        """The plain transformers model whose weights the rollout holds."""
        return tiny_model(family, seed=0, **cls.model_overrides.get(family, {}))

    @pytest.fixture(scope="class")
    @classmethod
    def other_reference(cls, family: str) -> torch.nn.Module:
        """Different weights of the same architecture, for weight updates."""
        return tiny_model(family, seed=1, **cls.model_overrides.get(family, {}))

    @pytest.fixture(scope="class")
    @classmethod
    def rollout(cls, family: str, reference: torch.nn.Module) -> Iterator[Rollout]:
        if not cls.backend:
            raise TypeError(f"{cls.__name__} must set the class attribute 'backend'")
        model = ModelConfig(tiny=family, seed=0, config_overrides=cls.model_overrides.get(family, {}))
        r = Rollout(cls.rollout_config(), model, EngineContext(role="rollout"))
        # The trainer always syncs before generating; doing it here also exercises update_weights.
        r.update_weights(named_tensors(reference))
        yield r
        r.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls) -> list[list[int]]:
        return encode_prompts()

    # ------------------------------------------------------------------ helpers

    def assert_logprobs_match(self, batch: Batch, model: torch.nn.Module) -> float:
        """Rollout log-probs equal the teacher-forced ones of ``model``; returns the max error."""
        expected = teacher_forced_log_probs(model, batch)
        got = batch["rollout_log_probs"].float()
        err = float((got - expected).abs().max())
        assert err <= self.logprob_atol, f"rollout log-probs differ from the transformers reference by {err:.3g}"
        return err

    # ------------------------------------------------------------------ layout

    def test_batch_layout(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        n = 3
        batch = rollout.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=0))
        rows = len(prompts) * n
        assert len(batch) == rows
        for key in ("input_ids", "attention_mask", "response_mask", "rollout_log_probs"):
            assert key in batch, f"generate must return '{key}'"
        shape = batch["input_ids"].shape
        assert shape[0] == rows
        for key in ("attention_mask", "response_mask", "rollout_log_probs"):
            assert batch[key].shape == shape, f"'{key}' is {tuple(batch[key].shape)}, input_ids {tuple(shape)}"
        assert batch["prompt_index"] == [i for i in range(len(prompts)) for _ in range(n)]
        assert len(batch["finish_reason"]) == rows
        assert set(batch["finish_reason"]) <= {"stop", "length"}

        width = batch.info["prompt_length"]
        assert width == max(len(p) for p in prompts)
        ids, attn, resp = batch["input_ids"], batch["attention_mask"].bool(), batch["response_mask"].bool()
        for r in range(rows):
            prompt = prompts[r // n]
            # Prompt: left-padded into the first `width` columns.
            assert attn[r, :width].tolist() == [False] * (width - len(prompt)) + [True] * len(prompt)
            assert ids[r, width - len(prompt) : width].tolist() == prompt
            assert not resp[r, :width].any()
            # Response: right-padded after the prompt, contiguous, inside the attention mask.
            length = int(resp[r].sum())
            assert 1 <= length <= 8
            assert resp[r, width : width + length].all() and not resp[r, width + length :].any()
            assert attn[r, width:].tolist() == resp[r, width:].tolist()
        assert shape[1] == width + max(int(resp[r].sum()) for r in range(rows)), "no all-padding columns at the end"
        lp = batch["rollout_log_probs"]
        assert (lp[~resp] == 0).all(), "log-probs outside the response must be 0"
        assert (lp[resp] <= 0).all() and torch.isfinite(lp[resp]).all()

    # ------------------------------------------------------------------ numbers

    def test_logprobs_match_reference(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        # Temperature, top-k and top-p change what is sampled, never the reported log-probs.
        for sampling in (
            SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=1),
            SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=2),
        ):
            batch = rollout.generate(prompts, sampling)
            self.assert_logprobs_match(batch, reference)

    def test_greedy_matches_reference(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        batch = rollout.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=10))
        got = responses(batch)
        for i, prompt in enumerate(prompts):
            expected = reference_greedy(reference, prompt, 10)
            assert got[2 * i] == expected, f"prompt {i}: greedy {got[2 * i]} != reference {expected}"
            assert got[2 * i + 1] == expected, "greedy samples of one prompt must be identical"
        assert batch["finish_reason"] == ["length"] * len(batch)
        self.assert_logprobs_match(batch, reference)

    def test_seed_reproducible(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11)
        first = rollout.generate(prompts, sampling)
        rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=12))
        again = rollout.generate(prompts, sampling)
        assert torch.equal(first["input_ids"], again["input_ids"]), "the same seed must give the same samples"
        assert torch.allclose(first["rollout_log_probs"], again["rollout_log_probs"], atol=self.logprob_atol, rtol=0)

    def test_different_seeds_differ(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        a = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=21))
        b = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=22))
        assert responses(a) != responses(b), "different seeds gave identical samples"
        # Samples of one prompt differ from each other too.
        ra = responses(a)
        assert any(ra[2 * i] != ra[2 * i + 1] for i in range(len(prompts)))

    def test_samples_do_not_depend_on_the_split(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        """Placement-invariant sampling (:mod:`geartrain.seeding`): the prompts generated in
        one call, or as data-parallel shares in any order (``prompt_indices``), give the
        same samples and log-probs."""
        whole = responses(rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=31)))
        order = list(range(len(prompts)))[::-1]
        shares = [order[: len(order) // 2], order[len(order) // 2 :]]
        got: dict[int, list[list[int]]] = {}
        for share in shares:
            sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=31, prompt_indices=share)
            part = responses(rollout.generate([prompts[i] for i in share], sampling))
            for k, i in enumerate(share):
                got[i] = part[2 * k : 2 * k + 2]
        assert [s for i in range(len(prompts)) for s in got[i]] == whole, "a sample changed with the split"

    # ------------------------------------------------------------------ limits

    def test_max_tokens(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        batch = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3))
        assert [len(r) for r in responses(batch)] == [5] * len(batch)
        assert batch["finish_reason"] == ["length"] * len(batch)

    def test_max_model_len_caps_generation(self, rollout: Rollout) -> None:
        room = 3
        prompt = encode_prompts(("y" * (self.max_model_len - room - 1),))[0]
        assert len(prompt) == self.max_model_len - room
        batch = rollout.generate([prompt], SamplingParams(temperature=1.0, max_tokens=10, seed=4))
        assert [len(r) for r in responses(batch)] == [room]
        assert batch["finish_reason"] == ["length"]

    def test_stop_token_greedy(self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]) -> None:
        # Stop on a token whose first occurrence in a greedy continuation is as late as
        # possible (tiny random models often repeat one token: then it is the first step).
        candidates = []
        for prompt in prompts:
            free = reference_greedy(reference, prompt, 10)
            k = max(i for i in range(len(free)) if free[i] not in free[:i])
            candidates.append((k, prompt, free))
        k, prompt, free = max(candidates, key=lambda c: c[0])
        batch = rollout.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[free[k]]))
        assert responses(batch) == [free[: k + 1]], "generation must stop after the stop token, keeping it"
        assert batch["finish_reason"] == ["stop"]

    def test_stop_tokens_sampled(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        stop = list(range(64, 128))  # half the vocabulary: most rows stop early
        batch = rollout.generate(
            prompts, SamplingParams(n=4, temperature=1.0, max_tokens=12, stop_token_ids=stop, seed=5)
        )
        stopped = 0
        for resp, reason in zip(responses(batch), batch["finish_reason"], strict=True):
            assert not set(resp[:-1]) & set(stop), "a row went on after a stop token"
            if reason == "stop":
                assert resp[-1] in stop
                stopped += 1
            else:
                assert len(resp) == 12 and resp[-1] not in stop
        assert stopped > 0

    # ------------------------------------------------------------------ multi-turn (agent turns)

    def test_continuation_matches_one_shot(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        """A turn continues from token ids: generating ``k`` tokens, then ``m`` more from
        prompt + those ``k``, gives the tokens (and, within tolerance, the log-probs) of
        one call of ``k + m`` tokens (greedy)."""
        k, m = 12, 8
        whole = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k + m))
        first = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k))
        head = responses(first)
        assert head == [r[:k] for r in responses(whole)], "the first turn differs from the one-shot generation"
        prefixes = [prompt + tokens for prompt, tokens in zip(prompts, head, strict=True)]
        # twice: the second call finds the prefixes in a backend's prefix cache
        for _ in range(2):
            rest = rollout.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=m))
            assert responses(rest) == [r[k:] for r in responses(whole)], "the continuation differs from one-shot"
            tail = [row[k:] for row in response_log_probs(whole)]
            for row, (got, want) in enumerate(zip(response_log_probs(rest), tail, strict=True)):
                err = max(abs(a - b) for a, b in zip(got, want, strict=True))
                assert err <= self.logprob_atol, f"prompt {row}: continuation log-probs off by {err:.3g}"
            self.assert_logprobs_match(rest, reference)

    def test_stop_sequences_greedy(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        """Multi-token stop sequences: matched only within the tokens generated in this call
        (never across the prompt's end), the sequence kept, ``finish_reason`` ``stop``."""
        max_tokens = 12
        free = [reference_greedy(reference, prompt, max_tokens) for prompt in prompts]
        # [last prompt token, first response token]: straddles the prompt's end, so it may
        # only match later in the response; a backend that matched the prompt too would stop
        # every row after one token
        stops = [[prompt[-1], tokens[0]] for prompt, tokens in zip(prompts, free, strict=True)]
        # and a 3-token sequence whose first occurrence in a greedy response ends latest
        late = max(
            (
                (i, j)
                for i, tokens in enumerate(free)
                for j in range(len(tokens) - 2)
                if cut_at_stop(tokens, [tokens[j : j + 3]]) == j + 3
            ),
            key=lambda c: c[1],
        )
        stops.append(free[late[0]][late[1] : late[1] + 3])
        batch = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_sequences=stops))
        cuts = [cut_at_stop(tokens, stops) for tokens in free]
        assert responses(batch) == [t[:c] if c else t for t, c in zip(free, cuts, strict=True)]
        assert batch["finish_reason"] == ["stop" if c else "length" for c in cuts]
        assert any(c is not None and c > 1 for c in cuts), "no row stopped on a multi-token sequence"
        self.assert_logprobs_match(batch, reference)

    def test_stop_sequences_cut_the_same_samples(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        """Seeded samples with stop sequences are the samples without them, cut after the
        first match in the response: the same tokens and log-probs (whether a backend stops
        natively or generates on and cuts)."""
        sampling = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=41)
        free = rollout.generate(prompts, sampling)
        tokens, log_probs = responses(free), response_log_probs(free)
        stops = [
            tokens[0][4:6],  # two tokens
            tokens[5][2:5],  # three tokens
            tokens[10][7:8],  # one token, like stop_token_ids
            prompts[0][-2:],  # the prompt's end: never matched in the prompt itself
        ]
        stopped = rollout.generate(
            prompts, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=41, stop_sequences=stops)
        )
        cuts = [cut_at_stop(row, stops) for row in tokens]
        expected = [row[:c] if c else row for row, c in zip(tokens, cuts, strict=True)]
        assert responses(stopped) == expected, "stop sequences changed the samples or cut them at the wrong place"
        assert stopped["finish_reason"] == ["stop" if c else "length" for c in cuts]
        for row, (got, want) in enumerate(zip(response_log_probs(stopped), log_probs, strict=True)):
            err = max((abs(a - b) for a, b in zip(got, want[: len(got)], strict=False)), default=0.0)
            assert err <= self.logprob_atol, f"row {row}: log-probs changed by {err:.3g} with stop sequences"
        assert sum(c is not None and c > 1 for c in cuts) >= 2, "too few rows stopped on a multi-token sequence"

    def test_budget_per_prompt(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        """``max_tokens_per_prompt``: each prompt's samples are exactly its budget long (the
        same samples as with one budget, cut), or shorter when a stop token ends them."""
        budgets = [3, 9, 1, 6][: len(prompts)]
        n = 2
        free = rollout.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=12, seed=43))
        batch = rollout.generate(
            prompts, SamplingParams(n=n, temperature=1.0, max_tokens=12, max_tokens_per_prompt=budgets, seed=43)
        )
        rows_budget = [budgets[i] for i in batch["prompt_index"]]
        assert responses(batch) == [r[:b] for r, b in zip(responses(free), rows_budget, strict=True)]
        assert batch["finish_reason"] == ["length"] * len(batch)
        for row, (got, want) in enumerate(zip(response_log_probs(batch), response_log_probs(free), strict=True)):
            err = max(abs(a - b) for a, b in zip(got, want[: len(got)], strict=False))
            assert err <= self.logprob_atol, f"row {row}: log-probs changed by {err:.3g} with a per-prompt budget"

        stop = list(range(96, 128))  # a quarter of the vocabulary: some rows stop early
        batch = rollout.generate(
            prompts,
            SamplingParams(
                n=4, temperature=1.0, max_tokens=2, max_tokens_per_prompt=budgets, stop_token_ids=stop, seed=44
            ),
        )
        rows_budget = [budgets[i] for i in batch["prompt_index"]]
        for resp, reason, budget in zip(responses(batch), batch["finish_reason"], rows_budget, strict=True):
            assert len(resp) <= budget
            if reason == "length":
                assert len(resp) == budget and not set(resp) & set(stop)
            else:
                assert resp[-1] in stop and not set(resp[:-1]) & set(stop)
        assert any(len(r) > 2 for r in responses(batch)), "the per-prompt budgets must replace max_tokens"

    def test_episode_logprobs_match_reference(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        """Multi-turn episodes (:class:`~geartrain.agents.EpisodeRunner`, three model turns
        with observations between them): the training row's rollout log-probs equal the
        teacher-forced log-probs of the whole row (what the trainer computes) on the
        model's tokens, and the episodes do not depend on how they were split into calls."""
        runner = EpisodeRunner(
            rollout.generate,
            tiny_tokenizer(),
            _CountdownEnvironment,
            RunnerLimits(max_turns=3, max_tokens_per_turn=6, max_model_len=self.max_model_len),
        )
        sampling = SamplingParams(temperature=1.0, seed=51)
        tasks = [{"prompt": str(i)} for i in range(len(prompts))]
        episodes, _ = runner.run(prompts, tasks, sampling)
        assert [(e.finish, e.model_turns) for e in episodes] == [("done", 3)] * len(prompts), [
            e.error for e in episodes
        ]
        batch = episode_batch(episodes, pad_token_id=0)
        mask = batch["response_mask"].bool()
        assert int(mask.sum()) == 3 * 6 * len(prompts), "every model turn uses its whole budget (no stops)"
        assert int(mask.sum()) < int(batch["attention_mask"][:, batch.info["prompt_length"] :].sum()), "no observations"
        self.assert_logprobs_match(batch, reference)

        # the same episodes run as two shares, in reverse order (another rank's share)
        order = list(range(len(prompts)))[::-1]
        split: dict[int, list[int]] = {}
        for share in (order[: len(order) // 2], order[len(order) // 2 :]):
            part, _ = runner.run(
                [prompts[i] for i in share], [tasks[i] for i in share], sampling, episode_indices=share
            )
            split.update({i: e.token_ids() for i, e in zip(share, part, strict=True)})
        whole = [e.token_ids() for e in episodes]
        assert [split[i] for i in range(len(prompts))] == whole, "an episode changed with the split"

    def test_update_weights_resets_prefix_cache(
        self, rollout: Rollout, reference: torch.nn.Module, other_reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        """A turn after a weight update is scored with the new weights only: KV computed
        for the episode's prefix with the old weights is not reused."""
        first = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        prefixes = [prompt + tokens for prompt, tokens in zip(prompts, responses(first), strict=True)]
        rollout.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=4))  # prefixes now cached
        try:
            rollout.update_weights(named_tensors(other_reference))
            turn = rollout.generate(prefixes, SamplingParams(temperature=1.0, max_tokens=8, seed=45))
            self.assert_logprobs_match(turn, other_reference)
        finally:
            rollout.update_weights(named_tensors(reference))
        turn = rollout.generate(prefixes, SamplingParams(temperature=1.0, max_tokens=8, seed=45))
        self.assert_logprobs_match(turn, reference)

    def test_top_k_restricts_support(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        k = 3
        batch = rollout.generate(prompts, SamplingParams(n=8, temperature=1.0, top_k=k, max_tokens=4, seed=6))
        first = self._check_support(
            batch, reference, lambda logits, token: int((logits > logits[token] + 1e-4).sum()) < k
        )
        assert len(first) > 1, "top-k sampling collapsed to one token"

    def test_top_p_restricts_support(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        p, temperature = 0.3, 0.7

        def in_nucleus(logits: torch.Tensor, token: int) -> bool:
            # The nucleus is taken after temperature scaling (as vLLM does).
            probs = torch.softmax(logits / temperature, dim=-1)
            # The mass of the tokens more probable than this one must be below p.
            return float(probs[probs > probs[token] * (1 + 1e-4)].sum()) < p + 1e-4

        sampling = SamplingParams(n=8, temperature=temperature, top_p=p, max_tokens=4, seed=7)
        batch = rollout.generate(prompts, sampling)
        first = self._check_support(batch, reference, in_nucleus)
        assert len(first) > 1, "top-p sampling collapsed to one token"

    def test_sampling_frequencies_match_reference(self, rollout: Rollout, reference: torch.nn.Module) -> None:
        """Many one-token samples: frequencies follow softmax(top-k logits / temperature)."""
        prompt = encode_prompts()[0]
        n, k, temperature = 1000, 4, 0.8
        sampling = SamplingParams(n=n, temperature=temperature, top_k=k, max_tokens=1, seed=13)
        batch = rollout.generate([prompt], sampling)
        first = batch["input_ids"][:, batch.info["prompt_length"]]
        top = torch.topk(reference_logits(reference, torch.tensor(prompt))[-1], k)
        expected = torch.softmax(top.values / temperature, dim=-1)
        counts = torch.stack([(first == t).sum() for t in top.indices]).float()
        assert int(counts.sum()) == n, "a token outside the top-k was sampled"
        # Four standard deviations of a frequency over 1000 draws are at most 0.064.
        freq = counts / n
        assert float((freq - expected).abs().max()) < 0.064, f"frequencies {freq.tolist()} vs {expected.tolist()}"

    def _check_support(self, batch: Batch, reference: torch.nn.Module, allowed: Any) -> set[tuple[int, int]]:
        """Every sampled token passes ``allowed(reference logits, token)``; returns the
        distinct (prompt, first token) pairs."""
        width = batch.info["prompt_length"]
        first: set[tuple[int, int]] = set()
        for r, seq in enumerate(sequences(batch)):
            logits = reference_logits(reference, seq)
            n = int(batch["response_mask"][r].sum())
            for t in range(len(seq) - n, len(seq)):
                token = int(seq[t])
                assert allowed(logits[t - 1], token), (
                    f"row {r}: token {token} at step {t} is outside the allowed support"
                )
            first.add((batch["prompt_index"][r], int(batch["input_ids"][r, width])))
        return first

    # ------------------------------------------------------------------ weights and memory

    def test_update_weights_and_sync_back(
        self, rollout: Rollout, reference: torch.nn.Module, other_reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=8)
        before = rollout.generate(prompts, sampling)
        try:
            rollout.update_weights(named_tensors(other_reference))
            changed = rollout.generate(prompts, sampling)
            self.assert_logprobs_match(changed, other_reference)
            old = teacher_forced_log_probs(reference, changed)
            assert float((old - changed["rollout_log_probs"]).abs().max()) > 1e-3, "update_weights changed nothing"
        finally:
            rollout.update_weights(named_tensors(reference))
        after = rollout.generate(prompts, sampling)
        assert torch.equal(after["input_ids"], before["input_ids"]), (
            "syncing the old weights back must reproduce the samples"
        )
        self.assert_logprobs_match(after, reference)

    def test_partial_update_keeps_other_tensors(
        self, rollout: Rollout, reference: torch.nn.Module, other_reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        # The input embedding (tied to the output layer in qwen2) and one MLP matrix.
        names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"]
        source = other_reference.state_dict()
        hybrid = copy.deepcopy(reference)
        hybrid.load_state_dict({n: source[n] for n in names}, strict=False)
        try:
            rollout.update_weights((n, source[n].clone()) for n in names)
            batch = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=9))
            self.assert_logprobs_match(batch, hybrid)
        finally:
            rollout.update_weights(named_tensors(reference))

    def test_release_resume_keeps_weights(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=10)
        before = rollout.generate(prompts, sampling)
        released = rollout.release()
        resumed = rollout.resume()
        for stats in (released, resumed):
            assert isinstance(stats, MemoryStats)
            assert stats.before >= 0 and stats.after >= 0 and stats.seconds >= 0
        after = rollout.generate(prompts, sampling)
        assert torch.equal(after["input_ids"], before["input_ids"]), "release/resume changed the samples"
        self.assert_logprobs_match(after, reference)

    # ------------------------------------------------------------------ LoRA (rollouts declaring 'lora')

    lora_rank: ClassVar[int] = 8
    """Rank of the random adapters the LoRA test serves (the rollout is built with
    ``max_lora_rank`` = this)."""

    @pytest.fixture(scope="class")
    @classmethod
    def lora_rollout(cls, family: str, reference: torch.nn.Module) -> Iterator[Rollout]:
        """A second instance, built to serve adapters (only for backends declaring ``lora``)."""
        from geartrain import plugins

        if "lora" not in plugins.backend_info("rollout", cls.backend).capabilities:
            pytest.skip(f"rollout '{cls.backend}' does not declare lora")
        model = ModelConfig(tiny=family, seed=0, config_overrides=cls.model_overrides.get(family, {}))
        config = cls.rollout_config().model_copy(update={"max_lora_rank": cls.lora_rank})
        r = Rollout(config, model, EngineContext(role="rollout"))
        r.update_weights(named_tensors(reference))
        yield r
        r.shutdown()

    def random_adapter(
        self, reference: torch.nn.Module, seed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.nn.Module]:
        """A PEFT-named adapter on every linear layer of the decoder, its adapter config, and
        the plain model with the adapter merged in (the reference its samples must match)."""
        g = torch.Generator().manual_seed(seed)
        r, alpha = self.lora_rank, 2.0 * self.lora_rank
        merged = copy.deepcopy(reference)
        tensors: dict[str, torch.Tensor] = {}
        targets = set()
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                a = torch.randn(r, module.in_features, generator=g) * 0.05
                b = torch.randn(module.out_features, r, generator=g) * 0.05
                tensors[f"base_model.model.{name}.lora_A.weight"] = a
                tensors[f"base_model.model.{name}.lora_B.weight"] = b
                with torch.no_grad():
                    merged.get_submodule(name).weight += (alpha / r) * b @ a
                targets.add(name.rsplit(".", 1)[-1])
        config = {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": alpha,
            "target_modules": sorted(targets),
            "use_rslora": False,
            "bias": "none",
            "lora_dropout": 0.0,
            "base_model_name_or_path": None,
        }
        return tensors, config, merged

    def test_update_adapter_serves_base_plus_scaled_BA(
        self, lora_rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        """``update_adapter``: samples follow ``W + alpha/r B A``; a second adapter of the same
        name replaces the first (it does not stack); the adapter survives release/resume."""
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11)
        first_tensors, config, first = self.random_adapter(reference, seed=1)
        lora_rollout.update_adapter("policy", first_tensors, config)
        batch = lora_rollout.generate(prompts, sampling)
        self.assert_logprobs_match(batch, first)
        base = teacher_forced_log_probs(reference, batch)
        assert float((base - batch["rollout_log_probs"]).abs().max()) > 1e-3, "the adapter changed nothing"
        second_tensors, config, second = self.random_adapter(reference, seed=2)
        lora_rollout.update_adapter("policy", second_tensors, config)
        self.assert_logprobs_match(lora_rollout.generate(prompts, sampling), second)
        lora_rollout.release()
        lora_rollout.resume()
        self.assert_logprobs_match(lora_rollout.generate(prompts, sampling), second)

    # ------------------------------------------------------------------ errors

    def test_unknown_tensor_name_raises(
        self, rollout: Rollout, reference: torch.nn.Module, prompts: list[list[int]]
    ) -> None:
        bogus = "model.layers.99.not_a_weight"
        with pytest.raises((GeartrainError, KeyError, ValueError)) as info:
            rollout.update_weights(iter([(bogus, torch.zeros(4))]))
        assert bogus in str(info.value), f"the error must name the unknown tensor: {info.value}"
        batch = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        self.assert_logprobs_match(batch, reference)

    def test_prompt_longer_than_max_model_len_raises(self, rollout: Rollout, prompts: list[list[int]]) -> None:
        too_long = encode_prompts(("z" * (self.max_model_len + 5),))[0]
        with pytest.raises((GeartrainError, ValueError)) as info:
            rollout.generate([prompts[0], too_long], SamplingParams(max_tokens=4, seed=0))
        assert str(self.max_model_len) in str(info.value), f"the error must give the limit: {info.value}"
