"""The asynchronous episode scheduler.

Episodes advance independently. Each generation call batches every episode that is ready
*at that moment* (its environment has answered), not a synchronous round that waits for
the slowest episode; environment steps (tool calls) run on a thread pool while the next
generation runs; when nothing is ready the runner waits for the first step to finish.

Sampling is placement-invariant: turn ``k`` of episode ``e`` draws from the stream keyed
``e * TURN_STRIDE + k`` (``SamplingParams.prompt_indices``, one sample per episode), so an
episode's tokens do not depend on what else was batched with it or on which rank ran it.

Limits: ``max_turns`` model turns; each turn at most ``max_tokens_per_turn`` tokens and
what is left of the episode's ``max_episode_tokens`` (prompt + episode within the
rollout's ``max_model_len``). An episode that runs out of tokens is truncated and marked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from geartrain.agents.env_state import capture_state
from geartrain.agents.environment import EnvironmentFactory, StepResult
from geartrain.agents.formats import chat_bridge, chat_opening, user_turn_tail
from geartrain.agents.loading import EnvironmentRouter
from geartrain.agents.trajectory import Episode, Segment
from geartrain.batch import Batch
from geartrain.daemon_pool import DaemonThreadPool
from geartrain.errors import GeartrainError, short_repr
from geartrain.stop_texts import stop_text_end
from geartrain.types import SamplingParams

logger = logging.getLogger("geartrain.agents")

__all__ = ["TURN_STRIDE", "EpisodeRunner", "RunnerLimits", "environment_stop_texts", "episode_metrics"]

#: Sampling streams per episode: turn k of episode e uses key e * TURN_STRIDE + k.
TURN_STRIDE = 1024
#: A lone UTF-16 surrogate: no character, and no tokenizer or UTF-8 writer takes one.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
#: The least "typical duration" the batching window is a share of (before anything is measured).
MIN_TYPICAL_S = 0.01

Generate = Callable[[list[list[int]], SamplingParams], Batch]


@dataclass(kw_only=True, slots=True)
class RunnerLimits:
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_episode_tokens: int | None = None
    max_model_len: int = 512


class EpisodeRunner:
    """Runs episodes with ``generate`` (a rollout's ``generate``) and environments from
    ``factory``. ``tokenizer`` encodes observations (once each) and decodes model turns
    for the environment. ``stop_texts`` end a model turn (added to the environment's
    own ``stop_texts``): the rollout stops on their token encoding, and a turn whose text
    holds one however spelled is cut right after it (:mod:`geartrain.stop_texts`);
    ``chat_template`` renders observations as chat turns."""

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        factory: EnvironmentFactory | EnvironmentRouter,
        limits: RunnerLimits,
        *,
        stop_texts: Sequence[str] = (),
        chat_template: bool = False,
        observation_role: str = "tool",
        workers: int = 32,
        batch_wait: float = 0.1,
        step_timeout_s: float | None = None,
        said: set[str] | None = None,
    ) -> None:
        if limits.max_turns >= TURN_STRIDE:
            raise GeartrainError(f"rollout.agent.max_turns must be below {TURN_STRIDE}, got {limits.max_turns}")
        self.generate = generate
        self.tokenizer = tokenizer
        self.factory = factory
        self.limits = limits
        self.chat_template = chat_template
        self.observation_role = observation_role
        self.workers = workers
        self.batch_wait = batch_wait
        self.step_timeout_s = step_timeout_s
        """Seconds an environment's ``reset`` / ``step`` may take before its episode ends
        as an error (``None``: no limit)."""
        self._user_tail: str | None = None
        """:func:`user_turn_tail` of the tokenizer, rendered at the first prompt extension."""
        self.final_rewards: dict[int, tuple[Any, BaseException | None]] = {}
        """``final_reward`` outcomes computed on a worker thread with an episode's last step,
        by ``id`` of the episode, until :meth:`_finish` takes them."""
        self.observations_cut = 0
        """Observations cut to their episode's remaining budget before tokenizing
        (``agent/observation_truncated``)."""
        self._chars_per_token: int | None = None
        self.said = said if said is not None else set()
        """Notes said once for all the runners that share this set (the trainer passes one
        set per job and process: an observation cut is said once per run, not per step)."""
        self.logged_failures: set[str] = set()
        """Kinds of environment failure (``what: type``) already logged by this runner: the
        first of each kind is logged with its traceback, the rest are only counted."""
        """After the first step of a wait finishes, wait this share of the mean generation
        or step time (whichever is longer) for more before generating (0: generate at once)."""
        texts = list(stop_texts)
        for one in factory.factories.values() if isinstance(factory, EnvironmentRouter) else [factory]:
            probe = self._new_env_of(one)
            try:
                texts += environment_stop_texts(probe)
            finally:
                self._close(probe)
        self.stop_texts = [t for t in dict.fromkeys(texts) if t]
        self.stop_sequences = [tokenizer.encode(t, add_special_tokens=False) for t in self.stop_texts]

    # ------------------------------------------------------------------ pieces
    def _new_env(self, task: Mapping[str, Any]) -> tuple[Any, Mapping[str, Any]]:
        """An environment for an episode of ``task`` and the task its ``reset`` gets: with
        named environments, the one the task names, without the naming column."""
        if isinstance(self.factory, EnvironmentRouter):
            return self._new_env_of(self.factory.for_task(task)), self.factory.task_for_reset(task)
        return self._new_env_of(self.factory), task

    def _new_env_of(self, factory: EnvironmentFactory) -> Any:
        env = factory()
        if self.chat_template and hasattr(env, "chat"):
            env.chat = True  # its stop texts and observations follow the chat template
        return env

    def _observation_ids(self, observation: str | Sequence[str]) -> list[int]:
        texts = [observation] if isinstance(observation, str) else list(observation)
        if self.chat_template:
            text = chat_bridge(self.tokenizer, texts, self.observation_role)
        else:
            text = "".join(texts)
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _token_chars(self) -> int:
        """The most characters one token of the tokenizer stands for (its longest vocabulary
        entry; 64 where the vocabulary cannot be read): a text longer than ``n`` times this
        has more than ``n`` tokens."""
        if self._chars_per_token is None:
            try:
                vocab = self.tokenizer.get_vocab()
                self._chars_per_token = max(8, max((len(t) for t in vocab), default=1))
            except Exception:  # noqa: BLE001 - any tokenizer: an upper bound is enough
                self._chars_per_token = 64
        return self._chars_per_token

    def _cut(self, ep: Episode, obs: str | Sequence[str]) -> str | Sequence[str]:
        """``obs`` cut to what the episode's remaining token budget could hold, before it is
        tokenized: a megabyte from a tool must not be tokenized whole to be thrown away (a
        cut observation still does not fit, so its episode ends as truncated, as it would
        have). Counted in ``agent/observation_truncated``, said once per :attr:`said` (once per run in the trainer)."""
        texts = [obs] if isinstance(obs, str) else list(obs)
        total = sum(len(t) for t in texts)
        limit = (max(self._room(ep), 0) + 1) * self._token_chars()
        if total <= limit:
            return obs
        kept, left = [], limit
        for text in texts:
            kept.append(text[:left])
            left -= len(kept[-1])
        self.observations_cut += 1
        if "observation cut" not in self.said:
            self.said.add("observation cut")
            logger.warning(
                "an observation of %d characters was cut to %d before tokenizing (the episode had room for %d "
                "tokens; more like it are counted in agent/observation_truncated, not logged)",
                total,
                limit,
                max(self._room(ep), 0),
            )
        return kept[0] if isinstance(obs, str) else kept

    def _as_text(self, obs: str | Sequence[str]) -> str | Sequence[str]:
        """``obs`` with each lone UTF-16 surrogate (what ``bytes.decode(errors="surrogateescape")``
        makes of bytes that are not UTF-8: a tool relaying a program's output or a file name)
        replaced by U+FFFD, the replacement character, as a UTF-8 decoder with
        ``errors="replace"`` shows them: no tokenizer encodes a lone surrogate. Said once per
        :attr:`said`."""
        texts = [obs] if isinstance(obs, str) else list(obs)
        if not any(_LONE_SURROGATE.search(t) for t in texts):
            return obs
        if "observation surrogates" not in self.said:
            self.said.add("observation surrogates")
            logger.warning(
                "an observation held text that is not UTF-8 (lone surrogates, as bytes decoded with "
                "errors='surrogateescape' give); each became U+FFFD, the replacement character (said once)"
            )
        fixed = [_LONE_SURROGATE.sub("\ufffd", t) for t in texts]
        return fixed[0] if isinstance(obs, str) else fixed

    def _room(self, ep: Episode) -> int:
        """Tokens the episode may still add after its prompt."""
        cap = self.limits.max_model_len - len(ep.prompt_ids)
        if self.limits.max_episode_tokens is not None:
            cap = min(cap, self.limits.max_episode_tokens)
        return cap - ep.used

    def _final_reward(self, ep: Episode) -> tuple[Any, BaseException | None]:
        """``(value, None)`` from the environment's ``final_reward()`` (``None`` without
        one), or ``(None, the exception)`` it raised or timed out with."""
        final_reward = getattr(ep.env, "final_reward", None)
        if not callable(final_reward):
            return None, None
        try:
            return _within(self.step_timeout_s, "final_reward", lambda _: final_reward(), None), None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # sys.exit, asyncio's CancelledError: this episode's error, not the job's
            return None, exc

    def _score_truncated(self, ep: Episode) -> None:
        """On a worker thread: the ``final_reward`` of an episode its token budget ended."""
        self.final_rewards[id(ep)] = self._final_reward(ep)

    def _step(self, ep: Episode, text: str) -> Any:
        """The environment's step on a worker thread; when the episode ends with it (done,
        or its last allowed turn), its ``final_reward`` too, so a slow score (a judge
        model) holds up only its own episode."""
        result = _within(self.step_timeout_s, "step", ep.env.step, text)
        # fields checked before they are read: a done that is no bool ("False", an array) is the episode's error
        usable = isinstance(result, StepResult) and _step_result_problem(result) is None
        if usable and (result.done or ep.model_turns >= self.limits.max_turns):
            self.final_rewards[id(ep)] = self._final_reward(ep)
        return result

    def _finish(self, ep: Episode, why: str, *, truncated: bool = False) -> None:
        scored = self.final_rewards.pop(id(ep), None)
        if why != "error" and ep.env is not None:
            # the environment's score of the whole episode (TRL's get_reward), on its last
            # turn: computed by _step where the episode ended with a step, else here
            value, exc = scored if scored is not None else self._final_reward(ep)
            if exc is not None:
                self._fail(ep, f"{type(exc).__name__}: {exc}", "final_reward", exc)
                return
            turns = [s for s in ep.segments if s.kind == "model"]
            if value is not None and turns:
                number = _finite(value)  # the rule of StepResult.reward
                if number is None:
                    self._fail(ep, f"final_reward returned {short_repr(value)}, not a finite number")
                    return
                turns[-1].reward += number
                turns[-1].info["final_reward"] = number
        ep.done, ep.finish, ep.truncated = True, why, truncated
        if ep.env is not None:
            ep.environment_state = capture_state(ep.env)  # before a pooled instance serves another episode
        self._close(ep.env)
        ep.env = None

    def _close(self, env: Any) -> None:
        close_environment(env, self.step_timeout_s, self.said)

    def _opening_ids(self, ep: Episode, obs: str | Sequence[str]) -> list[int] | None:
        """Under the chat template, the ids of a first observation (from ``reset``) as the
        template renders it: the observation turn(s) in place of the prompt's trailing
        generation prompt, which is taken off ``ep.prompt_ids`` and comes after them. ``None``
        when the prompt does not end with the template's generation prompt (then the
        observation follows it as after a model turn)."""
        texts = [obs] if isinstance(obs, str) else list(obs)
        opening, replacement = chat_opening(self.tokenizer, texts, self.observation_role)
        tail = list(self.tokenizer.encode(opening, add_special_tokens=False)) if opening else []
        if not tail or ep.prompt_ids[-len(tail) :] != tail:
            return None
        del ep.prompt_ids[-len(tail) :]
        return list(self.tokenizer.encode(replacement, add_special_tokens=False))

    def _extend_prompt(self, ep: Episode, obs: str | Sequence[str]) -> None:
        """Append a first observation to the prompt's last user message (an environment
        with ``reset_extends_prompt``, as TRL does): before the chat template's end of the
        user turn and generation prompt when the prompt ends with them, else at its end.
        The text is part of the prompt, not of the episode's response. When the task's
        ``prompt`` text is what the prompt's ids encode (the trainer's tasks), the extended
        text is encoded whole, as TRL tokenizes its re-rendered prompt (the tokens where the
        message and the extension meet may merge); else the extension's ids are inserted."""
        text = "".join([obs] if isinstance(obs, str) else obs)
        if self._user_tail is None:  # the tokenizer's template renders it the same for every episode
            self._user_tail = user_turn_tail(self.tokenizer)
        tail = self._user_tail
        prompt = ep.task.get("prompt")
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        if isinstance(prompt, str) and list(encode(prompt)) == ep.prompt_ids:
            at = len(prompt) - len(tail) if tail and prompt.endswith(tail) else len(prompt)
            ep.prompt_ids[:] = list(encode(prompt[:at] + text + prompt[at:]))
        else:
            tail_ids = list(encode(tail)) if tail else []
            at = len(ep.prompt_ids)
            if tail_ids and ep.prompt_ids[-len(tail_ids) :] == tail_ids:
                at -= len(tail_ids)
            ep.prompt_ids[at:at] = list(encode(text))
        ep.prompt_extension += text
        ep.prompt_text = self.tokenizer.decode(ep.prompt_ids, skip_special_tokens=False)

    def _observe(
        self, ep: Episode, obs: str | Sequence[str] | None, info: Mapping[str, Any], *, first: bool = False
    ) -> bool:
        """Append an observation (``first``: from ``reset``, before any model turn); ``True``
        when the episode goes on (room for a turn)."""
        if self._room(ep) < 1:  # a turn needs at least one token
            self._finish(ep, "truncated", truncated=True)
            return False
        if obs:
            obs = self._as_text(self._cut(ep, obs))
        ids = None
        if first and obs and getattr(ep.env, "reset_extends_prompt", False):
            self._extend_prompt(ep, obs)
            if self._room(ep) < 1:
                self._finish(ep, "truncated", truncated=True)
                return False
            return True
        if first and obs and self.chat_template:
            ids = self._opening_ids(ep, obs)
        if ids is None:
            ids = self._observation_ids(obs) if obs else []
        last = ep.segments[-1].ids if ep.segments and ep.segments[-1].kind == "model" else []
        if self.chat_template and ids and last and last[-1] == ids[0]:
            # the bridge starts with the template's end-of-turn token, which the turn already
            # ends with when it stopped on it (EOS = <|im_end|> / <|eot_id|>): once, not twice
            ids = ids[1:]
        if ids:
            if len(ids) + 1 > self._room(ep):
                self._finish(ep, "truncated", truncated=True)
                return False
            text = obs if isinstance(obs, str) else "".join(obs)
            ep.segments.append(Segment(kind="observation", ids=ids, text=text, info=dict(info)))
        return True

    # ------------------------------------------------------------------ the loop
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        tasks: Sequence[Mapping[str, Any]],
        sampling: SamplingParams,
        *,
        episode_indices: Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
    ) -> tuple[list[Episode], dict[str, float]]:
        """One episode per entry of ``prompts`` / ``tasks``. ``episode_indices`` (default
        ``0..``) key the sampling streams; ``groups`` (default: the same) name each
        episode's task. ``sampling``'s ``n`` must be 1: repeat a task for more episodes.
        Returns the episodes in input order and the scheduler's measurements."""
        if sampling.n != 1:
            raise GeartrainError("EpisodeRunner.run: sampling.n must be 1 (repeat a task's prompt for more episodes)")
        indices = list(episode_indices) if episode_indices is not None else list(range(len(prompts)))
        episodes = [
            Episode(index=i, group=g, prompt_ids=list(p), task=dict(t))
            for i, g, p, t in zip(indices, list(groups) if groups is not None else indices, prompts, tasks, strict=True)
        ]
        started = time.perf_counter()
        cut_before = self.observations_cut
        generate_s = 0.0
        calls = 0
        batch_sizes: list[int] = []
        text_cuts = 0
        # daemon threads: a step that never returns (step_timeout_s unset) must not hold the
        # process after Ctrl-C, as a ThreadPoolExecutor's threads, joined at exit, would
        pool = DaemonThreadPool(self.workers, thread_name_prefix="geartrain-env")
        pending: dict[Future[Any], tuple[Episode, str]] = {}
        ready: list[Episode] = []

        def reset(ep: Episode) -> str:
            ep.env, task = self._new_env(ep.task)
            return _within(self.step_timeout_s, "reset", ep.env.reset, task)

        submitted: dict[Future[Any], float] = {}
        step_s, steps = 0.0, 0
        for ep in episodes:
            fut = pool.submit(reset, ep)
            pending[fut], submitted[fut] = (ep, "reset"), time.perf_counter()
        try:
            while pending:
                done, rest = wait(list(pending), return_when=FIRST_COMPLETED)
                if rest:
                    # steps finishing within a sliver of a generation's (or a step's) mean
                    # time join this call rather than the next, so near-simultaneous tools
                    # do not split it into many small calls
                    typical = max(generate_s / max(calls, 1), step_s / max(steps, 1), MIN_TYPICAL_S)
                    more, _ = wait(rest, timeout=self.batch_wait * typical, return_when=ALL_COMPLETED)
                    done = set(done) | set(more)
                now = time.perf_counter()
                for fut in done:
                    ep, what = pending.pop(fut)
                    took = now - submitted.pop(fut)
                    if what != "truncated":  # scoring a truncated episode is not a step
                        step_s += took
                        steps += 1
                    if self._settle(ep, what, fut):
                        ready.append(ep)
                if not ready:
                    continue
                # every episode ready now goes into this call
                batch_eps, ready = ready, []
                start = time.perf_counter()
                turns = self._generate(batch_eps, sampling)
                generate_s += time.perf_counter() - start
                calls += 1
                batch_sizes.append(len(batch_eps))
                for ep, (ids, lps, reason) in zip(batch_eps, turns, strict=True):
                    end = stop_text_end(self.tokenizer, ids, self.stop_texts)
                    if end is not None and (end < len(ids) or reason != "stop"):
                        # the turn's text holds a stop text the rollout did not stop on (the
                        # model spelled it with other tokens than its encoding): it ends there
                        ids, lps, reason = ids[:end], lps[:end], "stop"
                        text_cuts += 1
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    ep.segments.append(Segment(kind="model", ids=ids, text=text, log_probs=lps))
                    if reason == "length" and self._room(ep) <= 0:
                        # scored on a worker thread like an episode that ends with a step (a
                        # slow final_reward holds up only this episode), then finished here
                        fut = pool.submit(self._score_truncated, ep)
                        pending[fut], submitted[fut] = (ep, "truncated"), time.perf_counter()
                        continue
                    fut = pool.submit(self._step, ep, text)
                    pending[fut], submitted[fut] = (ep, "step"), time.perf_counter()
        finally:
            for ep in episodes:
                if ep.env is not None:
                    self._close(ep.env)
                    ep.env = None
            pool.shutdown(wait=False, cancel_futures=True)
        total = time.perf_counter() - started
        metrics = {
            "agent/generate_calls": float(calls),
            "agent/episodes_per_call": sum(batch_sizes) / max(calls, 1),
            "agent/stop_text_cut_turns": float(text_cuts),
            "agent/observation_truncated": float(self.observations_cut - cut_before),
            "timing/agent_generate_s": generate_s,
            "timing/agent_episodes_s": total,
        }
        return episodes, metrics

    def _settle(self, ep: Episode, what: str, fut: Future[Any]) -> bool:
        """Take a finished reset/step; ``True`` when the episode needs its next turn."""
        try:
            result = fut.result()
        except Exception as exc:  # an environment's bug ends its episode, not the run
            return self._fail(ep, f"{type(exc).__name__}: {exc}", what, exc)
        except SystemExit as exc:  # sys.exit in an environment ends its episode, not the training process
            return self._fail(ep, f"SystemExit: {what} called sys.exit({exc.code!r})", what, exc)
        except BaseException as exc:  # asyncio's CancelledError, a library's own BaseException: the episode's
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C stays Ctrl-C
                raise
            return self._fail(ep, f"{type(exc).__name__}: {exc}", what, exc)
        if what == "truncated":
            self._finish(ep, "truncated", truncated=True)
            return False
        if what == "reset":
            if result is not None and not isinstance(result, str):
                return self._fail(
                    ep, f"reset returned {type(result).__name__}, not a str (the first observation) or None"
                )
            return self._observe(ep, result or None, {}, first=True)
        if not isinstance(result, StepResult):
            return self._fail(ep, f"step returned {type(result).__name__}, not a StepResult")
        problem = _step_result_problem(result)
        if problem is not None:
            return self._fail(ep, problem)
        turn = ep.segments[-1]
        turn.reward = float(result.reward)
        turn.info = dict(result.info or {})
        if result.done:
            self._finish(ep, "done")
            return False
        if ep.model_turns >= self.limits.max_turns:
            self._finish(ep, "max_turns")
            return False
        return self._observe(ep, result.observation, {})

    def _fail(self, ep: Episode, error: str, what: str | None = None, exc: BaseException | None = None) -> bool:
        """End ``ep`` as an environment error; the first failure of each kind in this
        runner (one per step and rank in the trainer) is logged, with its traceback when it raised."""
        ep.error = _LONE_SURROGATE.sub("\ufffd", error)  # an exception's text about a file name that is not UTF-8
        self._finish(ep, "error")
        kind = f"{what or 'result'}: {type(exc).__name__ if exc else error.split(' ', 1)[0]}"
        if kind not in self.logged_failures:
            self.logged_failures.add(kind)
            # one line (where it raised, not a traceback at every step); the traceback at DEBUG
            timed_out = isinstance(exc, EnvironmentTimeout)  # raised by the runner's own clock, not the environment
            logger.warning(
                "environment %s%s (its episode %d ends as an error; more like it in this step are counted in "
                "agent/env_errors, not logged): %s",
                f"{what} timed out" if timed_out else f"{what} raised" if exc else "returned a bad result",
                f" at {raised_at(exc)}" if exc is not None and not timed_out and raised_at(exc) else "",
                ep.index,
                error.splitlines()[0][:500] if error else error,
            )
            if exc is not None:
                logger.debug("the environment's traceback:", exc_info=exc)
        return False

    def _generate(self, episodes: list[Episode], sampling: SamplingParams) -> list[tuple[list[int], list[float], str]]:
        budgets = [min(self.limits.max_tokens_per_turn, self._room(ep)) for ep in episodes]
        params = dataclasses.replace(
            sampling,
            n=1,
            max_tokens=max(budgets),
            max_tokens_per_prompt=budgets,
            stop_sequences=list(sampling.stop_sequences) + self.stop_sequences,
            prompt_indices=[ep.index * TURN_STRIDE + ep.model_turns for ep in episodes],
        )
        batch = self.generate([ep.token_ids() for ep in episodes], params)
        width = int(batch.info["prompt_length"])
        out = []
        for row in range(len(episodes)):
            n = int(batch["response_mask"][row].sum())
            ids = batch["input_ids"][row, width : width + n].tolist()
            lps = batch["rollout_log_probs"][row, width : width + n].tolist()
            out.append((ids, lps, batch["finish_reason"][row]))
        return out


def raised_at(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame ``exc`` passed through ("" if none)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"


class EnvironmentTimeout(TimeoutError):
    """An environment's ``reset`` or ``step`` ran past ``rollout.agent.step_timeout_s``."""


def _within(timeout_s: float | None, what: str, fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)``, or :class:`EnvironmentTimeout` once it has run ``timeout_s`` seconds; the
    call then goes on on a daemon thread (it cannot be stopped, and must not hold up the
    job's exit as a pool thread would)."""
    if timeout_s is None:
        return fn(arg)
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def target() -> None:
        try:
            box.append((True, fn(arg)))
        except BaseException as exc:  # handed to the caller's thread as is
            box.append((False, exc))
        done.set()

    threading.Thread(target=target, name=f"geartrain-env-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise EnvironmentTimeout(f"{what} took longer than {timeout_s:g} s (rollout.agent.step_timeout_s)")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def close_environment(env: Any, timeout_s: float | None, said: set[str] | None = None) -> None:
    """``env.close()``, if it has one, within ``timeout_s`` (``rollout.agent.step_timeout_s``):
    closing must not fail, end or hold up a job whose episode is over, so what it raises
    (``sys.exit`` included) is ignored, and a close still running at the deadline is left on
    its daemon thread and said once per ``said`` (the notes a run's runners share; ``None``:
    not said, the run's episodes will); after
    that, closes are started on daemon threads and not waited for, so that a close that
    always hangs costs the run one timeout, not one per episode."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    if said is not None and "close timeout" in said:
        threading.Thread(target=_quietly, args=(close,), name="geartrain-env-close", daemon=True).start()
        return
    try:
        _within(timeout_s, "close", lambda _: close(), None)
    except EnvironmentTimeout:
        if said is not None and "close timeout" not in said:  # None: a probe's close, which the run says
            said.add("close timeout")
            logger.warning(
                "%s.close() did not return within %g s (rollout.agent.step_timeout_s): left running, the run "
                "goes on and later closes are not waited for (said once)",
                type(env).__name__,
                timeout_s,
            )
    except (Exception, SystemExit):  # closing must not fail an episode that is over, nor end the job
        pass


def _quietly(close: Callable[[], Any]) -> None:
    try:
        close()
    except BaseException:  # noqa: BLE001 - a close nobody waits for: nothing to report to
        pass


def environment_stop_texts(env: Any) -> list[str]:
    """``env.stop_texts`` (none: ``[]``); :class:`GeartrainError` naming the class when it
    is not a list of strings: a bare string would end a turn at each of its characters, a
    number is no text to stop on."""
    own = getattr(env, "stop_texts", None) or []
    if isinstance(own, str | bytes) or not isinstance(own, Sequence) or not all(isinstance(t, str) for t in own):
        raise GeartrainError(
            f"{type(env).__name__}.stop_texts must be a list of strings (the texts that end a model turn), "
            f"got {own!r:.200}"
        )
    return list(own)


def _step_result_problem(result: StepResult) -> str | None:
    """What is wrong with a :class:`StepResult`'s fields (``None``: nothing)."""
    done = result.done
    if not (isinstance(done, bool) or (type(done).__module__ == "numpy" and type(done).__name__ in ("bool", "bool_"))):
        # "False" from a JSON environment server is true: every episode ended after one turn
        return f"StepResult.done is {short_repr(done)}, not a bool"
    obs = result.observation
    if not (
        obs is None or isinstance(obs, str) or (isinstance(obs, (list, tuple)) and all(isinstance(o, str) for o in obs))
    ):
        return f"StepResult.observation is {type(obs).__name__}, not a str, a list of str or None"
    if _finite(result.reward) is None:
        return f"StepResult.reward is {short_repr(result.reward)}, not a finite number"
    return _info_problem(result.info)


def _info_problem(info: Any) -> str | None:
    """What is wrong with a ``StepResult.info`` for the keys the run reads from it (the
    counts of tool calls and errors, their latencies, the calls): one episode's bad ``info``
    must end that episode, not fail the step that sums every episode's."""
    if info is None:
        return None
    if not isinstance(info, Mapping):
        return f"StepResult.info is {type(info).__name__}, not a dict"
    for key in ("tool_calls", "tool_errors"):
        value = info.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            return f"StepResult.info[{key!r}] is {short_repr(value)}, not a count (an int >= 0)"
    latencies = info.get("tool_latencies_s", [])
    if not isinstance(latencies, (list, tuple)) or any(_finite(x) is None for x in latencies):
        return f"StepResult.info['tool_latencies_s'] is {short_repr(latencies)}, not a list of finite numbers"
    calls = info.get("calls", [])
    if not isinstance(calls, (list, tuple)) or not all(isinstance(c, Mapping) for c in calls):
        return f"StepResult.info['calls'] is {short_repr(calls)}, not a list of dicts"
    return None


def _finite(reward: Any) -> float | None:
    """``reward`` as a float when it is a finite number of any kind (int, float, bool, a
    numpy scalar, a one-element tensor), else ``None``."""
    try:
        value = None if isinstance(reward, (str, bytes)) else float(reward)
    except Exception:  # noqa: BLE001 - an int past the largest float (OverflowError), a type whose float() raises
        return None
    return value if value is not None and math.isfinite(value) else None


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def episode_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-step agent metrics from episode records (:meth:`Episode.record`): turns per
    episode, tool calls, tool errors, tool-call success rate, tool latency p50/p95,
    truncated episodes, episodes that hit ``max_turns`` or failed, model vs observation tokens,
    and the environment's reward per episode (its turns' rewards summed)."""
    n = max(len(records), 1)
    calls = sum(r["tool_calls"] for r in records)
    errors = sum(r["tool_errors"] for r in records)
    latencies = [x for r in records for x in r["tool_latencies_s"]]
    return {
        "agent/turns_mean": sum(r["model_turns"] for r in records) / n,
        "agent/tool_calls": float(calls),
        "agent/tool_calls_per_episode": calls / n,
        "agent/tool_errors": float(errors),
        "agent/tool_success_rate": (calls - errors) / calls if calls else 0.0,
        "agent/tool_latency_p50_s": _percentile(latencies, 0.5),
        "agent/tool_latency_p95_s": _percentile(latencies, 0.95),
        "agent/truncated": float(sum(bool(r["truncated"]) for r in records)),
        "agent/max_turns_hit": float(sum(r["finish"] == "max_turns" for r in records)),
        "agent/env_errors": float(sum(r["finish"] == "error" for r in records)),
        "agent/env_error_fraction": sum(r["finish"] == "error" for r in records) / n if records else 0.0,
        "agent/model_tokens_mean": sum(r["model_tokens"] for r in records) / n,
        "agent/observation_tokens_mean": sum(r["observation_tokens"] for r in records) / n,
        "agent/env_reward_mean": sum(sum(r.get("rewards", ())) for r in records) / n,
    }
