"""Scoring a batch of responses with a reward function, robust to a function that fails.

A sample whose function raises, returns a non-finite score, or returns something that is
not a number or a dict with a numeric ``score`` gets reward 0; it is counted in
``reward/errors`` and the run goes on; so does a sample whose batch ran past
``timeout_s`` (also counted in ``reward/timeouts``). A :class:`RewardScorer` logs its first
failure (logger ``geartrain.rewards``, WARNING, with the sample and the traceback) and its
first timeout once; after that they are only counted.

A function that returns ``None`` for a sample does not apply to it (TRL's multi-task
convention): that term is absent for the sample, the sample's reward is the weighted sum of
the terms that are present, and the term's own metric leaves the sample out. A sample for
which *every* term returns ``None`` has no reward: it is a failure as above.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from numbers import Real
from typing import Any

import torch

from geartrain.errors import short_repr
from geartrain.rewards.registry import RewardFn, RewardOutput
from geartrain.rewards.terms import Messages, RewardContext, RewardTerm, TrainerState, as_terms, call_batched
from geartrain.workdir import WorkingDirectoryGuard

logger = logging.getLogger("geartrain.rewards")


@dataclass(kw_only=True, slots=True)
class RewardResult:
    """Scores of a batch.

    ``scores`` ``[B]`` float32; ``extras[key]`` one entry per sample (``None`` where the
    function gave none) for the numeric extras of dict outputs (``acc``...); ``errors``
    the indices of failed samples (``timeouts`` those of them not scored in time);
    ``metrics``: ``reward/mean``, ``reward/errors`` and ``reward/<extra>`` (mean over
    samples that reported it), always :func:`summarize` of the rest.

    :meth:`rows` and :meth:`from_rows` carry a result across processes one sample at a
    time, so that the shares scored by several reward workers are put back together in
    the batch's order and summarised over the whole batch.
    """

    scores: torch.Tensor
    extras: dict[str, list[float | None]] = field(default_factory=dict)
    errors: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    term_scores: dict[str, list[float | None]] = field(default_factory=dict)
    """Each term's own score per sample, by term name (``None`` where it failed or
    returned ``None``: absent)."""
    timeouts: list[int] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """Columns the functions logged for the completions log (TRL's ``log_extra``), one
    value per sample."""
    term_errors: dict[str, list[int]] = field(default_factory=dict)
    """Several terms: by term name, the samples it failed on that the others still scored
    (``reward/<term>/errors``)."""
    _exact: list[float] | None = field(default=None, repr=False)
    """The scores as the function returned them (``scores`` is float32)."""

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per sample: ``score``, ``terms``, ``extras``, ``error``,
        ``timeout``, ``columns``."""
        failed, late = set(self.errors), set(self.timeouts)
        return [
            {
                "score": self._exact[i] if self._exact is not None else float(self.scores[i]),
                "terms": {name: values[i] for name, values in self.term_scores.items()},
                "extras": {key: values[i] for key, values in self.extras.items() if values[i] is not None},
                "error": i in failed,
                "timeout": i in late,
                "columns": {key: values[i] for key, values in self.columns.items()},
                "failed_terms": [name for name, rows in self.term_errors.items() if i in rows],
            }
            for i in range(len(self.scores))
        ]

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> RewardResult:
        """The result whose :meth:`rows` are ``rows``, with its metrics summarised over all
        of them (from the scores as the function returned them, before float32)."""
        n = len(rows)
        exact = [float(row["score"]) for row in rows]
        scores = torch.tensor(exact, dtype=torch.float32)
        names = list(rows[0]["terms"]) if rows else []
        term_scores = {name: [row["terms"].get(name) for row in rows] for name in names}
        extras: dict[str, list[float | None]] = {}
        for i, row in enumerate(rows):
            for key, value in row["extras"].items():
                extras.setdefault(key, [None] * n)[i] = value
        errors = [i for i, row in enumerate(rows) if row["error"]]
        timeouts = [i for i, row in enumerate(rows) if row["timeout"]]
        term_errors: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            for name in row.get("failed_terms") or ():
                term_errors.setdefault(name, []).append(i)
        metrics = summarize(exact, extras, term_scores, errors, timeouts, term_errors)
        columns: dict[str, list[Any]] = {}
        for i, row in enumerate(rows):
            for key, value in (row.get("columns") or {}).items():
                columns.setdefault(key, [None] * n)[i] = value
        return cls(
            scores=scores,
            extras=extras,
            errors=errors,
            metrics=metrics,
            term_scores=term_scores,
            timeouts=timeouts,
            columns=columns,
            term_errors=term_errors,
            _exact=exact,
        )


def correctness(result: RewardResult) -> list[float]:
    """Per sample 1.0 / 0.0: the function's ``acc`` extra where it gave one, else ``score > 0``
    (a score that is not finite, a broken reward, is never a correct answer)."""
    acc = result.extras.get("acc", [None] * len(result.scores))
    return [
        float(a) if a is not None else float(math.isfinite(s) and s > 0)
        for a, s in zip(acc, result.scores.tolist(), strict=True)
    ]


def summarize(
    scores: Sequence[float],
    extras: Mapping[str, Sequence[float | None]],
    term_scores: Mapping[str, Sequence[float | None]],
    errors: Sequence[int],
    timeouts: Sequence[int],
    term_errors: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, float]:
    """A batch's reward metrics: ``reward/mean``, ``reward/errors``, ``reward/timeouts``,
    ``reward/error_fraction``, each term's ``reward/<term>/mean`` when there are several
    (the mean over the samples it scored: absent and failed ones are left out, and a term
    that scored none of the batch has no such metric that step) and ``reward/<term>/errors``
    (the samples it failed on that the others scored), and ``reward/<extra>``
    (the mean over the samples that reported it; ``reward/extra/<extra>`` when that name is
    one of the above, e.g. an extra called ``mean``)."""
    n = len(scores)
    metrics = {
        "reward/mean": sum(scores) / n if n else 0.0,
        "reward/errors": float(len(errors)),
        "reward/timeouts": float(len(timeouts)),
        "reward/error_fraction": len(errors) / n if n else 0.0,
    }
    if len(term_scores) > 1:
        for name, values in term_scores.items():
            present = [v for v in values if v is not None]
            if present:
                metrics[f"reward/{name}/mean"] = sum(present) / len(present)
        for name, failed in (term_errors or {}).items():
            metrics[f"reward/{name}/errors"] = float(len(failed))
    for key, values in extras.items():
        present = [v for v in values if v is not None]
        if present:
            name = f"reward/{key}"
            if name in metrics:  # an extra named "mean" or "errors" must not stand in for the run's own
                name = f"reward/extra/{key}"
                if key not in _RENAMED_EXTRAS:
                    _RENAMED_EXTRAS.add(key)
                    logger.warning(
                        "a reward function's extra value '%s' is reported as %s: reward/%s is the reward's own metric",
                        key,
                        name,
                        key,
                    )
            metrics[name] = sum(present) / len(present)
    return metrics


#: extras renamed because their metric name is one of the reward's own (said once each)
_RENAMED_EXTRAS: set[str] = set()


class _BadOutput(ValueError):
    pass


class _Absent:
    """A term's outcome for a sample it returned ``None`` for (it does not apply)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


def _parse_or_absent(output: Any) -> tuple[float, dict[str, float]] | _Absent:
    return ABSENT if output is None else parse_output(output)


def parse_output(output: RewardOutput) -> tuple[float, dict[str, float]]:
    """``(score, numeric extras)`` of one reward output; raises ``ValueError`` naming what is
    wrong (no ``score`` key, not a number, not finite)."""
    if isinstance(output, Mapping):
        if "score" not in output:
            raise _BadOutput(f"reward dict has no 'score' key (keys: {sorted(output)})")
        score, extras = output["score"], {k: v for k, v in output.items() if k != "score"}
    else:
        score, extras = output, {}
    kind = type(score).__name__
    try:
        score = _plain_number(score)
        if isinstance(score, Decimal):  # a number too (numbers.Real leaves it out); sNaN has no float
            if not score.is_finite():
                raise _BadOutput(f"reward score is not finite ({score})")
        elif not isinstance(score, Real):
            raise _BadOutput(f"reward score is {type(score).__name__}, not a number")
        score = float(score)
    except _BadOutput:
        raise
    except OverflowError as exc:  # an int or Fraction beyond the largest float: no finite score
        raise _BadOutput(f"reward score {kind} is not finite as a float ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a number type's own float()/item() may raise anything
        raise _BadOutput(f"reward score {kind} has no float value ({type(exc).__name__}: {exc})") from None
    if not math.isfinite(score):
        raise _BadOutput(f"reward score is not finite ({score})")
    numeric = {k: f for k, v in extras.items() if (f := _finite_extra(v)) is not None}
    if extras.get("acc") is not None and "acc" not in numeric:
        # dropped, accuracy fell back to "score > 0": an always-wrong run with a format credit read 100 %
        raise _BadOutput(f"reward 'acc' is {type(extras['acc']).__name__} {extras['acc']!r:.60}, not a number or bool")
    return score, numeric


def _plain_number(value: Any) -> Any:
    """``value`` with the number types a reward may return as Python's: a one-element tensor's
    item (a meta tensor has no value: it raises), numpy's bool (a comparison's result) as a
    bool; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    return value


def _finite_extra(value: Any) -> float | None:
    """A dict output's extra ``value`` as a finite float, else ``None`` (left out of the
    metrics). The number types a score may be are numbers here too: numpy's bool (a
    comparison's result: ``"acc": np.bool_(ok)``), a one-element tensor, a ``Decimal``;
    dropped, an ``acc`` fell back to "score > 0" and a run that was always wrong read 100 %."""
    try:
        value = _plain_number(value)
        if not isinstance(value, Real | Decimal):
            return None
        number = float(value)
    except Exception:  # noqa: BLE001 - an int past the largest float, a float subclass that raises
        return None
    return number if math.isfinite(number) else None


class RewardExit(RuntimeError):
    """A reward function called ``sys.exit``: a failure of the samples it was scoring, not
    the end of the job (a ``SystemExit`` would end the scoring thread silently, read as a
    timeout after ``reward.timeout_s``, or end the job where no timeout is set)."""


def exited(exc: BaseException) -> RewardExit:
    """The :class:`RewardExit` for ``exc``: a ``SystemExit`` (saying the code it exited with)
    or another ``BaseException`` that is no ``Exception`` (asyncio's ``CancelledError`` from
    the function's own event loop, a library's own). ``KeyboardInterrupt`` on the main
    thread is raised again (Ctrl-C stays Ctrl-C); on another thread, where Python never
    delivers Ctrl-C, it is the function's own raise, and a failure like the others."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise exc
    if isinstance(exc, SystemExit):
        return RewardExit(f"the reward function called sys.exit({exc.code!r})")
    return RewardExit(f"the reward function raised {type(exc).__name__}: {exc}")


def run_within(n: int, call: Callable[[int], Any], timeout_s: float | None, name: str) -> list[Any]:
    """``call(0) ... call(n - 1)`` one after another, on a daemon thread when ``timeout_s``
    is set; the results of the calls that returned within ``timeout_s`` (for all of them
    together), in order. A call still running then is abandoned: it keeps its thread (named
    after ``name``) and its result is dropped. ``timeout_s=None``: every call, in this thread."""
    if timeout_s is None:
        return [call(i) for i in range(n)]
    results: list[Any] = []
    raised: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    done = threading.Event()

    def work() -> None:
        try:
            for i in range(n):
                out = call(i)
                with lock:
                    if stop.is_set():
                        return
                    results.append(out)
        except BaseException as exc:  # noqa: BLE001 - the waiter's to raise: a dead thread read as a timeout
            raised.append(exc)
        done.set()

    threading.Thread(target=work, name=f"geartrain-reward-{name}", daemon=True).start()
    finished = done.wait(timeout_s)
    with lock:
        if not finished:
            stop.set()
        elif raised:
            raise raised[0]
        return list(results)


class RewardScorer:
    """Scores batches with the job's reward terms (one function, or several with weights:
    :mod:`geartrain.rewards.terms`) over a run.

    A sample's reward is ``sum(weight x score)`` over the terms that apply to it (a term
    that returns ``None`` for a sample is absent from its sum, as TRL's ``nansum``). A term
    that raises or returns something unusable for a sample is left out of its sum too, named
    (its first failure logged) and counted in ``reward/<term>/errors``, while the others
    still score it; a sample no term scored (every term failed or returned ``None``, or the
    job's one function failed) gets reward 0 and is counted in ``reward/errors``. A term
    that returns ``None`` for every sample of a batch is said once.
    ``timeout_s`` bounds the time one batch's calls may take together: when it runs out,
    the call in progress and the samples not yet scored get reward 0 and are counted in
    ``reward/timeouts`` (and ``reward/errors``), and the run goes on. (A Python thread
    cannot be killed: a call that hangs forever keeps its daemon thread.) The first
    failure and the first timeout of the scorer's life are logged in full, with the
    traceback; later ones are only counted, in the metrics.
    """

    def __init__(self, fn: Any, *, timeout_s: float | None = None) -> None:
        self.terms: list[RewardTerm] = as_terms(fn)
        self.reward = self.terms[0].fn
        self.name = "+".join(t.name for t in self.terms)
        self.timeout_s = timeout_s
        self._failures_logged: set[str] = set()
        """Terms whose first failure was logged (with its traceback), once in the scorer's life."""
        self._never_scored_said: set[str] = set()
        self._timeout_logged = False
        self._workdir = WorkingDirectoryGuard()
        """A function that calls ``os.chdir`` is undone after its call (the run's relative paths)."""

    def _calls(
        self, responses: Sequence[str], truths: list[str], prompts: Sequence[str], metas: list[dict[str, Any]]
    ) -> list[tuple[int, int | None]]:
        """The units of work, in order: ``(term, sample)`` for per-sample terms,
        ``(term, None)`` for a batched term's one call."""
        units: list[tuple[int, int | None]] = []
        for t, term in enumerate(self.terms):
            units += [(t, None)] if term.batched else [(t, i) for i in range(len(responses))]
        return units

    def _call(
        self,
        unit: tuple[int, int | None],
        responses: Sequence[str],
        truths: list[str],
        prompts: Sequence[str],
        metas: list[dict[str, Any]],
        conversations: Sequence[Messages | None] | None = None,
        context: RewardContext | None = None,
    ) -> Any:
        term, i = self.terms[unit[0]], unit[1]
        try:
            return self._call_term(term, i, responses, truths, prompts, metas, conversations, context)
        finally:
            self._workdir.restore(f"reward function '{term.name}'")

    def _call_term(
        self,
        term: RewardTerm,
        i: int | None,
        responses: Sequence[str],
        truths: list[str],
        prompts: Sequence[str],
        metas: list[dict[str, Any]],
        conversations: Sequence[Messages | None] | None,
        context: RewardContext | None,
    ) -> Any:
        try:
            if i is None:
                outs = call_batched(
                    term.fn, list(prompts), list(responses), truths, metas, term.truth_column, conversations, context
                )
                parsed: list[Any] = []
                for out in outs:
                    try:
                        parsed.append(_parse_or_absent(out))
                    except _BadOutput as exc:
                        parsed.append(exc)
                return parsed
            return _parse_or_absent(term.fn(responses[i], truths[i], prompt=prompts[i], meta=dict(metas[i])))
        except Exception as exc:  # a user function's bug must not stop the run
            return exc
        except BaseException as exc:  # nor its sys.exit (or another BaseException), which would end the
            return exited(exc)  # scoring thread silently (a "timeout")

    def _run(self, n: int, call: Callable[[int], Any]) -> list[Any]:
        """``call(i)`` for each unit; the results before the deadline, in order."""
        return run_within(n, call, self.timeout_s, self.name)

    def _log_failure(
        self,
        name: str,
        i: int,
        out: BaseException,
        prompts: Sequence[str],
        responses: Sequence[str],
        truths: list[str],
        *,
        others_scored: bool = False,
    ) -> None:
        consequence = (
            f"left out of the sample's reward, the other functions still score it; this traceback is logged once, "
            f"further failures are counted in reward/{name}/errors"
            if others_scored
            else "reward 0; this traceback is logged once, further failures are counted in reward/errors"
        )
        logger.warning(
            "reward function %s failed on sample %d (%s): %s: %s\n  prompt=%r\n  response=%r\n  ground_truth=%r",
            name,
            i,
            consequence,
            type(out).__name__,
            out,
            prompts[i][:500],
            responses[i][:500],
            truths[i][:200],
            exc_info=(type(out), out, out.__traceback__) if not isinstance(out, _BadOutput) else None,
        )

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        *,
        prompts: Sequence[str] | None = None,
        metas: Sequence[Mapping[str, Any] | None] | None = None,
        conversations: Sequence[Messages | None] | None = None,
        trainer_state: TrainerState | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardResult:
        """Score every sample with every term (see the class docstring). ``conversations``:
        per sample, the messages of its row when the row is a conversation (``None`` for a
        plain prompt); a batched (TRL) term then gets TRL's shapes for that sample, a list of
        messages as its prompt and ``[{"role": "assistant", "content": response}]`` as its
        completion (:func:`~geartrain.rewards.terms.trl_shapes`). A batched term also gets
        TRL's ``trainer_state``, ``completion_ids``, ``log_metric`` (each name's values are
        averaged and reported as the extra ``<name>`` of every sample, so
        ``reward/<name>``) and ``log_extra`` (:attr:`RewardResult.columns`)."""
        n = len(responses)
        prompts = list(prompts) if prompts is not None else [""] * n
        metas_in = list(metas) if metas is not None else [None] * n
        if conversations is not None and len(conversations) != n:
            raise ValueError(f"score_batch needs one conversation (or None) per response: {len(conversations)} for {n}")
        if not (len(ground_truths) == len(prompts) == len(metas_in) == n):
            raise ValueError(
                f"score_batch needs one entry per response: {n} responses, {len(ground_truths)} ground truths, "
                f"{len(prompts)} prompts, {len(metas_in)} metas"
            )
        truths = ["" if t is None else str(t) for t in ground_truths]
        metas_d = [dict(m or {}) for m in metas_in]
        units = self._calls(responses, truths, prompts, metas_d)
        context = RewardContext(
            size=n,
            trainer_state=trainer_state,
            completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else None,
        )
        results = self._run(
            len(units), lambda u: self._call(units[u], responses, truths, prompts, metas_d, conversations, context)
        )
        # per term and sample: (score, extras), an exception, or None (not reached in time)
        outcome: list[list[Any]] = [[None] * n for _ in self.terms]
        for (t, i), out in zip(units, results, strict=False):
            if i is None:
                outcome[t] = list(out) if isinstance(out, list) else [out] * n
            else:
                outcome[t][i] = out
        timed_out = sorted({i for row in outcome for i, out in enumerate(row) if out is None})
        failed: list[int] = []
        logged_now: set[str] = set()
        scores = [0.0] * n
        term_scores: dict[str, list[float | None]] = {term.name: [None] * n for term in self.terms}
        term_errors: dict[str, list[int]] = {}
        extras: dict[str, list[float | None]] = {}
        several = len(self.terms) > 1
        for i in range(n):
            outs = [row[i] for row in outcome]
            broken = [t for t, out in enumerate(outs) if isinstance(out, BaseException)]
            scored = [t for t, out in enumerate(outs) if isinstance(out, tuple)]
            bad: BaseException | None = outs[broken[0]] if broken else None
            name = self.terms[broken[0]].name if broken else self.name
            if broken and scored and i not in timed_out:  # the others still score it; the failing one is named
                for t in broken:
                    term = self.terms[t].name
                    term_errors.setdefault(term, []).append(i)
                    if term not in self._failures_logged:
                        self._log_failure(term, i, outs[t], prompts, responses, truths, others_scored=True)
                        self._failures_logged.add(term)
                        logged_now.add(term)
                bad = None
            elif not broken and all(out is ABSENT for out in outs):
                bad = _BadOutput(
                    f"every reward function ({len(outs)}) returned None for this sample; "
                    "at least one must return a score for each sample"
                )
            if bad is not None:
                if name not in self._failures_logged:
                    self._log_failure(name, i, bad, prompts, responses, truths)
                    self._failures_logged.add(name)
                    logged_now.add(name)
                failed.append(i)
                continue
            if i in timed_out:
                continue
            total = 0.0
            for term, out in zip(self.terms, outs, strict=True):
                if not isinstance(out, tuple):  # absent, or failed while the others scored
                    continue
                score, numeric = out
                total += term.weight * score
                term_scores[term.name][i] = score
                for key, value in numeric.items():
                    extras.setdefault(f"{term.name}/{key}" if several else key, [None] * n)[i] = value
                    if several and key == "acc" and extras.setdefault("acc", [None] * n)[i] is None:
                        extras["acc"][i] = value  # accuracy: the first term that reports one
            scores[i] = total
        for name, values in context.metrics.items():  # log_metric: the batch's mean, on each sample
            extras[name] = [sum(values) / len(values)] * n
        errors = sorted(set(failed) | set(timed_out))
        if timed_out:
            level = logging.DEBUG if self._timeout_logged else logging.WARNING
            logger.log(
                level,
                "reward function %s timed out: reward.timeout_s = %ss for the batch ran out at sample %d of %d; it and "
                "the %d samples after it score 0 (counted in reward/timeouts; later timeouts are only counted)",
                self.name,
                self.timeout_s,
                timed_out[0],
                n,
                len(timed_out) - 1,
            )
            self._timeout_logged = True
        if logged_now and len(failed) > 1:
            names = "+".join(sorted(logged_now - set(term_errors))) or self.name
            logger.warning(
                "reward function %s failed on %d of %d samples (rows %s)", names, len(failed), n, failed[:20]
            )
        for name in sorted(logged_now & set(term_errors)):
            rows = term_errors[name]
            if len(rows) > 1:
                logger.warning(
                    "reward function %s failed on %d of %d samples (rows %s); the other functions scored them",
                    name,
                    len(rows),
                    n,
                    rows[:20],
                )
        if several and n and not timed_out:
            for term in self.terms:
                if term.name not in self._never_scored_said and all(
                    row is ABSENT for row in outcome[self.terms.index(term)]
                ):
                    self._never_scored_said.add(term.name)
                    logger.warning(
                        "reward function %s returned None for every one of the %d samples of this batch: it scores "
                        "nothing (None leaves a function out of a sample's reward); said once",
                        term.name,
                        n,
                    )
        metrics = summarize(scores, extras, term_scores, errors, timed_out, term_errors)
        return RewardResult(
            scores=torch.tensor(scores, dtype=torch.float32),
            extras=extras,
            errors=errors,
            metrics=metrics,
            term_scores=term_scores,
            timeouts=timed_out,
            columns=dict(context.columns),
            term_errors=term_errors,
            _exact=scores,
        )


def score_batch(
    fn: RewardFn | Callable[..., RewardOutput] | str,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    prompts: Sequence[str] | None = None,
    metas: Sequence[Mapping[str, Any] | None] | None = None,
    timeout_s: float | None = None,
    conversations: Sequence[Messages | None] | None = None,
) -> RewardResult:
    """Call ``fn`` (anything :func:`get_reward` accepts) once per sample, with a fresh
    :class:`RewardScorer` (so its first failure is logged).

    ``ground_truths`` entries are passed as ``str`` (``None`` as ``""``); ``prompts``
    default to ``""`` and ``metas`` to ``{}``; ``conversations`` as :meth:`RewardScorer.score`.
    """
    return RewardScorer(fn, timeout_s=timeout_s).score(
        responses, ground_truths, prompts=prompts, metas=metas, conversations=conversations
    )


def probe_term(
    term: RewardTerm,
    responses: list[str],
    truths: list[str],
    prompts: list[str],
    metas: list[dict[str, Any]],
    where: list[str],
    notes: list[str] | None = None,
    absent: list[int] | None = None,
    conversations: Sequence[Messages | None] | None = None,
    timeout_s: float | None = None,
    max_steps: int = 0,
) -> str | None:
    """Call ``term`` on a few samples as a run would and say what is wrong (``None``: it
    returned a usable score for each it did not raise on): a raise on every sample, or a
    return value that is not a number, a dict with a numeric ``score`` or ``None``. ``where``
    names each sample's data row. A per-sample function that raises on *some* samples only
    is what a run tolerates (those samples score 0 and are counted): that goes to ``notes``.
    The samples it returned ``None`` for (it does not apply to them) are appended to
    ``absent``: whether another term scores them is the caller's to check. ``conversations``
    as :meth:`RewardScorer.score` (a batched term gets TRL's shapes for those samples).
    ``timeout_s`` (the run's ``reward.timeout_s``) bounds the probe's calls together, as a
    run bounds a batch's: a call still running then is abandoned (a run scores it 0 and
    goes on: a note), so a function that hangs cannot hang the check. ``max_steps`` (the
    run's ``trainer.total_steps``) is the probe's ``trainer_state.max_steps``."""

    # TRL's run-time keywords as a run gives them (no step yet; the probed responses are text, not sampled ids)
    context = RewardContext(
        size=len(responses),
        trainer_state=TrainerState(global_step=0, max_steps=max_steps, epoch=0.0),
        completion_ids=[[] for _ in responses],
    )
    workdir = WorkingDirectoryGuard()

    def call(i: int) -> tuple[bool, Any]:
        try:
            return call_term(i)
        finally:
            workdir.restore(f"reward function '{term.name}'")

    def call_term(i: int) -> tuple[bool, Any]:
        try:
            if term.batched:
                return True, list(
                    call_batched(term.fn, prompts, responses, truths, metas, term.truth_column, conversations, context)
                )
            return True, term.fn(responses[i], truths[i], prompt=prompts[i], meta=dict(metas[i]))
        except Exception as exc:
            return False, exc
        except BaseException as exc:  # sys.exit, asyncio's CancelledError (Ctrl-C is raised again)
            return False, exited(exc)

    calls = 1 if term.batched else len(responses)
    returned = run_within(calls, call, timeout_s, term.name)
    if len(returned) < calls and notes is not None:
        row = where[0] if term.batched else where[len(returned)]
        notes.append(
            f"reward '{term.name}' did not return within reward.timeout_s = {timeout_s:g} s (probed rows "
            f"from {where[0]}; the call on {row} was abandoned): a run scores such samples 0 and counts them "
            "(reward/timeouts); raise reward.timeout_s if the function is only slow"
        )
    if term.batched:
        if not returned:
            return None
        ok, value = returned[0]
        if not ok:
            return f"raised {type(value).__name__}: {value} (called on {len(responses)} rows from {where[0]})"
        outs = list(enumerate(value))
    else:
        outs = []
        raised: list[str] = []
        for i, (ok, value) in enumerate(returned):
            if ok:
                outs.append((i, value))
            else:
                raised.append(f"raised {type(value).__name__}: {value} (on {where[i]}, response {responses[i]!r:.60})")
        if raised and not outs:
            return raised[0]
        if raised and notes is not None:
            notes.append(
                f"reward '{term.name}' {raised[0]}; {len(raised)} of {len(responses)} probed rows raised: "
                "a run scores those samples 0 and counts them (reward/errors)"
            )
    for i, out in outs:
        if out is None:
            if absent is not None:
                absent.append(i)
            continue
        try:
            parse_output(out)
        except ValueError as exc:
            return (
                f"returned {type(out).__name__} {short_repr(out)} on {where[i]}: {exc}; "
                "return a number, a dict with a numeric 'score', or None where the function does not apply"
            )
    return None


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score ``[B]`` on its last response token: ``[B, T]`` float32,
    0 elsewhere (rows with an empty mask get nothing). This is the ``token_rewards`` input
    of the advantage estimators."""
    mask = response_mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(device=mask.device, dtype=torch.float32)[rows]
    return out
