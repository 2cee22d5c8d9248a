"""Stop strings matched on text however the model's tokens spell them
(:mod:`geartrain.stop_texts`): the rule itself on a merging tokenizer, then the real torch
rollout's samples cut by single-turn generation and by the episode runner, each checked
against the uncut samples of the same seeded generation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import EpisodeRunner, RunnerLimits, StepResult
from geartrain.agents.runner import TURN_STRIDE
from geartrain.char_tokenizer import BOS, CHARACTERS, EOS, PAD, UNK
from geartrain.data import PromptBatch, PromptRow
from geartrain.layout import rollout_batch
from geartrain.stop_texts import cut_batch_at_stop_texts, stop_text_end
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.generation import Generation
from geartrain.trainer.roles import RewardWorker
from geartrain.trainer.run import greedy_accuracy
from geartrain.trainer.step_metrics import response_metrics
from transformers import PreTrainedTokenizerFast

VOCAB = 128  # the tiny models' vocabulary
STOP = "!"


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer's ids, and ids 100-127 as two-character tokens that end in
    ``"!"`` (``"a!"``, ``"b!"``, ...) and merge ``"a" "!"`` into one: ``"!"`` alone
    encodes to its character, and a model may spell it inside a merged token."""
    from tokenizers import Tokenizer, decoders, models

    tokens = [PAD, BOS, EOS, UNK, *CHARACTERS]
    letters = "abcdefghijklmnopqrstuvwxyzAB"
    tokens += [f"{c}{STOP}" for c in letters[: VOCAB - len(tokens)]]
    assert len(tokens) == VOCAB
    merges = [(t[0], t[1]) for t in tokens if len(t) == 2 and t.endswith(STOP)]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=UNK))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return merging_tokenizer()


@pytest.fixture(scope="module")
def rollout() -> Iterator[Rollout]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    r = Rollout(
        RolloutConfig(backend="torch", max_model_len=96),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    yield r
    r.shutdown()
    torch.set_num_threads(threads)


def test_the_tokenizer_spells_the_stop_text_two_ways(tok: Any) -> None:
    assert tok.encode(STOP, add_special_tokens=False) == [tok.convert_tokens_to_ids(STOP)]
    assert tok.encode("xa!", add_special_tokens=False) == [tok.convert_tokens_to_ids(t) for t in ("x", "a!")]


def test_stop_text_end_is_the_first_token_that_completes_the_text(tok: Any) -> None:
    ids = lambda *pieces: [tok.convert_tokens_to_ids(p) for p in pieces]  # noqa: E731
    assert stop_text_end(tok, ids("x", "y", "!"), [STOP]) == 3  # the canonical spelling, at the end
    assert stop_text_end(tok, ids("x", "a!", "y", "z"), [STOP]) == 2  # inside a merged token
    assert stop_text_end(tok, ids("x", "a!", "b!", "z"), [STOP]) == 2  # the first of several
    assert stop_text_end(tok, ids("x", "y"), [STOP]) is None
    assert stop_text_end(tok, ids("<", "/", "t", ">", "z"), ["</t>"]) == 4  # across tokens
    assert stop_text_end(tok, ids("x", "</s>"), ["</s>"]) == 2  # a special token's text counts
    assert stop_text_end(tok, ids("x", "a!"), ["", STOP]) == 2 and stop_text_end(tok, ids("x"), [""]) is None


def test_a_batch_is_cut_after_the_stop_text_and_padded(tok: Any) -> None:
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [ids("q1"), ids("long q2"), ids("q3"), ids("q4")]
    responses = [ids("xy!"), ids("xa!yz"), ids("xyz"), ids("xya!")]
    log_probs = [[-(r + 1) * 0.1 - k for k in range(len(resp))] for r, resp in enumerate(responses)]
    reasons = ["stop", "length", "length", "length"]
    batch = rollout_batch(
        prompts, responses, log_probs, prompt_index=[0, 1, 2, 3], finish_reason=reasons, pad_token_id=tok.pad_token_id
    )
    before = {k: v.clone() for k, v in batch.tensors.items()}
    cut = cut_batch_at_stop_texts(batch, tok, [STOP])

    assert cut == [False, True, False, True]  # the canonical stop and the row without one are left alone
    assert batch["finish_reason"] == ["stop", "stop", "length", "stop"]
    width = batch.info["prompt_length"]
    for row in (0, 2, 3):  # row 3 ends on "a!" at its limit: nothing to cut, but it stopped
        for key, value in before.items():
            assert torch.equal(batch[key][row], value[row]), (row, key)
    # row 1 keeps "x", "a!" and nothing after, as if the rollout had stopped there
    keep = width + 2
    assert tok.decode(batch["input_ids"][1][batch["response_mask"][1].bool()].tolist()) == "xa!"
    assert torch.equal(batch["input_ids"][1, :keep], before["input_ids"][1, :keep])
    assert torch.equal(batch["rollout_log_probs"][1, :keep], before["rollout_log_probs"][1, :keep])
    assert (batch["input_ids"][1, keep:] == tok.pad_token_id).all()
    for key in ("attention_mask", "response_mask", "rollout_log_probs"):
        assert (batch[key][1, keep:] == 0).all(), key


def _prompts(tok: Any) -> PromptBatch:
    texts = ["what is 2+2? ", "say hi: ", "count: ", "go "]
    rows = [PromptRow(prompt_ids=tok.encode(t, add_special_tokens=False), prompt=t, ground_truth="4") for t in texts]
    return PromptBatch(rows=rows, indices=list(range(len(rows))), epoch=0)


def test_single_turn_samples_of_the_torch_rollout_end_at_the_stop_text(rollout: Rollout, tok: Any) -> None:
    """``sampling.stop = ["!"]``: the rollout stops on the "!" token; samples that spell
    "!" inside a merged token run on and are cut by ``Generation.annotate`` right after
    that token, equal to the uncut sample up to it."""
    config = TrainConfig.model_validate({"sampling": {"stop": [STOP], "n": 8, "max_tokens": 24}})
    generation = Generation(config, None, tok, None)  # type: ignore[arg-type]
    prompts = _prompts(tok)
    sampling = generation.sampling(step=3)
    raw = rollout.generate(prompts.prompt_ids, sampling)
    batch = generation.annotate(rollout.generate(prompts.prompt_ids, sampling), prompts, sampling.n)

    width = raw.info["prompt_length"]
    cut = 0
    for row in range(len(batch)):
        mask, raw_mask = batch["response_mask"][row].bool(), raw["response_mask"][row].bool()
        kept, generated = batch["input_ids"][row][mask].tolist(), raw["input_ids"][row][raw_mask].tolist()
        assert generated[: len(kept)] == kept  # the same seeded sample, up to the cut
        n = len(kept)
        assert torch.equal(
            batch["rollout_log_probs"][row, width : width + n], raw["rollout_log_probs"][row, width : width + n]
        )
        text = tok.decode(kept)
        if STOP in text:
            assert text.index(STOP) >= len(text) - 2 and batch["finish_reason"][row] == "stop", text
            assert STOP not in tok.decode(kept[:-1])
        else:  # ran to its limit or stopped on EOS: untouched
            assert batch["finish_reason"][row] == raw["finish_reason"][row] and kept == generated
        assert batch["stop_text_cut"][row] == (
            n < len(generated) or batch["finish_reason"][row] != raw["finish_reason"][row]
        )
        cut += batch["stop_text_cut"][row]
        assert batch["response_text"][row] == tok.decode(kept, skip_special_tokens=True)
    assert cut > 0  # the random model spells "!" inside a merged token in some samples
    ratio = response_metrics(batch, step_s=1.0, generate_s=1.0)["response/stop_text_cut_ratio"]
    assert ratio == cut / len(batch)


class _Echo:
    """Ends after two model turns; observes ``"ok "``."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: dict) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(observation="ok ", done=self.turns >= 2)


def test_agent_turns_of_the_torch_rollout_end_at_the_stop_text(rollout: Rollout, tok: Any) -> None:
    """A turn of the real torch rollout that spells the environment's stop text inside a
    merged token is cut after that token: the environment sees text up to the stop, and
    the turn's tokens and log-probs equal the uncut first turn's up to it."""
    steps: list[str] = []

    class Env(_Echo):
        stop_texts = (STOP,)

        def step(self, action: str) -> StepResult:
            steps.append(action)
            return super().step(action)

    runner = EpisodeRunner(
        rollout.generate, tok, Env, RunnerLimits(max_turns=2, max_tokens_per_turn=20, max_model_len=96)
    )
    prompts = _prompts(tok).prompt_ids * 4
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=20, seed=11)
    episodes, metrics = runner.run(prompts, [{}] * len(prompts), sampling)

    cut = 0
    for ep in episodes:
        first = ep.segments[0]
        # the first turn again, uncut: the same seeded stream (the runner keys it by episode and turn)
        again = rollout.generate(
            [prompts[ep.index]],
            SamplingParams(
                n=1,
                temperature=1.0,
                max_tokens=20,
                seed=11,
                prompt_indices=[ep.index * TURN_STRIDE],
                stop_sequences=runner.stop_sequences,
            ),
        )
        w = again.info["prompt_length"]
        generated = again["input_ids"][0, w:][again["response_mask"][0, w:].bool()].tolist()
        assert generated[: len(first.ids)] == first.ids
        assert first.log_probs == pytest.approx(again["rollout_log_probs"][0, w : w + len(first.ids)].tolist())
        for turn in (s for s in ep.segments if s.kind == "model"):
            text = tok.decode(turn.ids)
            if STOP in text:
                assert STOP not in tok.decode(turn.ids[:-1]), text
        cut += len(first.ids) < len(generated)
    assert cut > 0
    assert metrics["agent/stop_text_cut_turns"] >= cut
    assert all(STOP not in s[:-2] for s in steps)  # what the environment was handed ends at the stop


class _RolloutGroup:
    """``group.call("generate", ...)`` on one real torch rollout (what an inline actor
    group's single rank does)."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    def call(self, method: str, prompts: Any, sampling: SamplingParams, **_: Any) -> Any:
        assert method == "generate"
        return self.rollout.generate(prompts["prompt_ids"], sampling)


def test_the_sft_dev_accuracy_ends_responses_at_sampling_stop_strings(rollout: Rollout) -> None:
    """The SFT warm start's greedy dev accuracy (``greedy_accuracy``) scores responses cut
    at ``sampling.stop`` as RL validation does: a reward that accepts only text ending at
    its first "!" scores every response that holds one. The tiny model's greedy choice
    repeats the prompt's last token, here a merged "a!": every response spells "!" inside it."""
    tok = merging_tokenizer()
    texts = [f"task {i} a!" for i in range(8)]
    rows = [PromptRow(prompt_ids=tok.encode(t, add_special_tokens=False), prompt=t, ground_truth="") for t in texts]
    prompts = PromptBatch(rows=rows, indices=list(range(len(rows))), epoch=0)
    config = TrainConfig.model_validate({"sampling": {"stop": [STOP], "max_tokens": 24}})

    def ends_at_first_stop(response: str, ground_truth: str, **_: Any) -> dict[str, float]:
        return {"score": 0.0, "acc": float(STOP in response and response.index(STOP) >= len(response) - 2)}

    scorer = RewardWorker(ends_at_first_stop, None, None, ctx=None)  # type: ignore[arg-type]
    group = _RolloutGroup(rollout)
    greedy = rollout.generate(prompts.prompt_ids, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[2]))
    holds_stop = [
        STOP in tok.decode(r[m.bool()].tolist())
        for r, m in zip(greedy["input_ids"], greedy["response_mask"], strict=True)
    ]
    assert all(holds_stop)
    assert greedy_accuracy(group, scorer, prompts.rows, tok, config) == sum(holds_stop) / len(holds_stop)


ECHO_ENV = """
from geartrain.agents import StepResult


class Echo:
    def reset(self, task):
        return ""

    def step(self, action):
        return StepResult(observation="ok ", done=True)
"""


def test_sampling_stop_strings_end_agent_turns_by_text_too(tok: Any, tmp_path: Any) -> None:
    """``sampling.stop`` ends a multi-turn episode's turn as it ends a single-turn sample:
    on its token encoding (the rollout) and on the text (a merged ``"a!"``); the turn ran
    on past a merged stop, and the environment got the text after it."""
    from geartrain.agents import AgentConfig
    from geartrain.trainer.episodes import episode_prompt_batch, run_episode_share
    from scripted_turns import scripted_generate

    (tmp_path / "echo_env.py").write_text(ECHO_ENV)
    turn = tok.encode("hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("a!")]
    turn += tok.encode(" more", add_special_tokens=False)
    assert tok.decode(turn) == "hia! more"
    prompts = episode_prompt_batch(PromptBatch(rows=_prompts(tok).rows[:1], indices=[0], epoch=0))
    agent = AgentConfig(environment="echo_env.py:Echo", max_turns=2)
    sampling = SamplingParams(n=1, max_tokens=16, stop_sequences=[tok.encode(STOP, add_special_tokens=False)])
    generate = scripted_generate(tok, [tok.decode(turn)])
    batch, metrics = run_episode_share(
        generate, tok, prompts, sampling, agent, base_dir=str(tmp_path), max_model_len=64
    )
    (record,) = batch["episode"]
    assert record["turns"][0]["text"] == "hia!"  # cut right after the token that completes "!"
    assert metrics["agent/stop_text_cut_turns"] == 1.0


def test_an_empty_stop_string_is_refused_by_name() -> None:
    """``sampling.stop = [""]`` reached the rollout as an empty token sequence and failed the
    first generation, after the models loaded, naming ``sampling.stop_sequences``."""
    with pytest.raises(ValueError, match=r"sampling.stop\[1\] is empty"):
        TrainConfig.model_validate({"sampling": {"stop": ["</answer>", ""]}})
    assert TrainConfig.model_validate({"sampling": {"stop": ["</answer>"]}}).sampling.stop == ["</answer>"]


def test_responses_end_at_every_eos_of_the_models_generation_config(rollout: Rollout, tmp_path: Any) -> None:
    """A chat model's generation_config.json lists several EOS ids (Qwen2.5's <|im_end|> and
    <|endoftext|>, Llama 3.x's <|eot_id|> and <|eom_id|>); TRL and vLLM stop on each, so the
    RL step's samples (and validation's, and the SFT dev's) do too, not only on the
    tokenizer's EOS. The tiny model's greedy choice repeats the prompt's last token (":"),
    listed here as a second EOS: every response is that one token."""
    from transformers import GenerationConfig

    tok = merging_tokenizer()
    colon = tok.convert_tokens_to_ids(":")
    GenerationConfig(eos_token_id=[tok.eos_token_id, colon]).save_pretrained(tmp_path)
    config = TrainConfig.model_validate({"model": {"path": str(tmp_path)}, "sampling": {"max_tokens": 24}})
    generation = Generation(config, None, tok, None)  # type: ignore[arg-type]
    assert generation.sampling(0).stop_token_ids == generation.greedy().stop_token_ids == [tok.eos_token_id, colon]
    prompts = [tok.encode(f"task {i}:", add_special_tokens=False) for i in range(4)]
    batch = rollout.generate(prompts, generation.greedy())
    assert batch["response_mask"].sum(1).tolist() == [1] * 4 and batch["finish_reason"] == ["stop"] * 4
    plain = TrainConfig.model_validate({"sampling": {"max_tokens": 24}})  # no generation_config.json
    assert Generation(plain, None, tok, None).greedy().stop_token_ids == [tok.eos_token_id]  # type: ignore[arg-type]
