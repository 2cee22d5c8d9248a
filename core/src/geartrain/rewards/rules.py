"""Built-in rule-based reward functions (registered by name).

| name | what earns 1.0 |
|---|---|
| ``arithmetic`` | the response starts with the integer ``ground_truth`` (``"19"``, ``" 19 because"``) |
| ``gsm8k`` | the number after the last ``#### `` equals the ground truth's |
| ``math_boxed`` | the last ``\\boxed{...}`` equals the ground truth (after normalisation) |
| ``format_boxed`` / ``format_gsm8k`` / ``format_think`` | the response has the format |

Answer scorers return ``{"score", "acc", "formatted"}``: ``acc`` is 1.0 for a correct
answer; ``score`` is 1.0 when correct, ``meta["format_score"]`` (default 0.0) when the
format is right but the answer wrong, 0.0 otherwise.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from geartrain.rewards.registry import register_reward

_INT_AT_START = re.compile(r"\s*([-+]?\d+)(?!\d)")
_GSM8K = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")
_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def _result(correct: bool, formatted: bool, meta: dict[str, Any]) -> dict[str, float]:
    format_score = float(meta.get("format_score", 0.0)) if meta else 0.0
    score = 1.0 if correct else (format_score if formatted else 0.0)
    return {"score": score, "acc": float(correct), "formatted": float(formatted)}


# ------------------------------------------------------------------ arithmetic
def leading_integer(text: str) -> int | None:
    """The integer the text starts with (after whitespace), or ``None``."""
    match = _INT_AT_START.match(text)
    return int(match.group(1)) if match else None


@register_reward("arithmetic")
def arithmetic(response: str, ground_truth: str, *, prompt: str = "", meta: dict[str, Any] | None = None) -> dict:
    """Exact match of the integer the response starts with (the answer right after a
    prompt like ``"12+7="``) against the integer ``ground_truth``."""
    predicted = leading_integer(response)
    return _result(
        predicted is not None and predicted == int(str(ground_truth).strip()), predicted is not None, meta or {}
    )


# ------------------------------------------------------------------ GSM8K
def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` with ``,`` and a trailing ``.`` removed, or ``None``."""
    found = _GSM8K.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a.strip() == b.strip()


@register_reward("gsm8k")
def gsm8k(response: str, ground_truth: str, *, prompt: str = "", meta: dict[str, Any] | None = None) -> dict:
    """GSM8K: the last ``#### N`` of the response equals the ground truth (a number, or a
    full solution ending in ``#### N``); ``1,000`` = ``1000`` = ``1000.0``."""
    predicted = gsm8k_answer(response)
    truth = gsm8k_answer(str(ground_truth)) or str(ground_truth).replace(",", "").strip()
    return _result(predicted is not None and _same_number(predicted, truth), predicted is not None, meta or {})


# ------------------------------------------------------------------ \boxed{} math
def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``None``
    if there is none or it is not closed. ``\\boxed 5`` (no braces) gives ``5``."""
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if boxed < 0 and fbox < 0:
        return None
    rest = text[boxed + len("\\boxed") :] if boxed > fbox else text[fbox + len("\\fbox") :]
    if rest.startswith(" "):
        token = rest.strip().split()
        return token[0].rstrip("$") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def normalize_math(answer: str) -> str:
    """A canonical string for a math answer: no spaces, ``$``, ``\\left``/``\\right``,
    ``\\!``, degree marks or trailing period; ``\\dfrac``/``\\tfrac`` -> ``\\frac``,
    ``\\text{x}`` -> ``x``; ``0.5`` and ``\\frac{1}{2}`` -> ``1/2``; ``a=5`` -> ``5``."""
    s = answer.strip()
    s = _TEXT.sub(r"\1", s)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[a-zA-Z]\w*=.+", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = _FRAC.sub(r"\1/\2", s)
    try:  # numbers (including a/b) compare by value
        value = Fraction(s.replace(",", "")) if re.fullmatch(r"[-+]?[\d,]*\.?\d+(/[-+]?\d+)?", s) else None
    except (ValueError, ZeroDivisionError):
        value = None
    if value is not None:
        return f"{value.numerator}/{value.denominator}" if value.denominator != 1 else str(value.numerator)
    return s


@register_reward("math_boxed")
def math_boxed(response: str, ground_truth: str, *, prompt: str = "", meta: dict[str, Any] | None = None) -> dict:
    """The last ``\\boxed{}`` of the response equals the ground truth (itself boxed or
    plain) after :func:`normalize_math`."""
    predicted = last_boxed(response)
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    correct = predicted is not None and normalize_math(predicted) == normalize_math(truth)
    return _result(correct, predicted is not None, meta or {})


# ------------------------------------------------------------------ format checks
@register_reward("format_boxed")
def format_boxed(response: str, ground_truth: str = "", *, prompt: str = "", meta: dict | None = None) -> float:
    """1.0 if the response has a closed ``\\boxed{...}``."""
    return float(last_boxed(response) is not None)


@register_reward("format_gsm8k")
def format_gsm8k(response: str, ground_truth: str = "", *, prompt: str = "", meta: dict | None = None) -> float:
    """1.0 if the response has a ``#### N`` answer line."""
    return float(gsm8k_answer(response) is not None)


@register_reward("format_think")
def format_think(response: str, ground_truth: str = "", *, prompt: str = "", meta: dict | None = None) -> float:
    """1.0 if the response is ``<think>...</think>`` followed by a non-empty answer."""
    return float(_THINK.match(response) is not None)


# ------------------------------------------------------------------ agents
@register_reward("environment")
def environment(response: str, ground_truth: str = "", *, prompt: str = "", meta: dict | None = None) -> dict:
    """For multi-turn jobs whose environment scores the episodes (``StepResult.reward``,
    ``final_reward``, TRL's ``get_reward``): adds nothing to those rewards (``score`` 0:
    they are already on the turns' tokens) and reports their sum as ``env_reward``, with
    ``acc`` = the environment rewarded the episode (``env_reward > 0``: what validation's
    accuracy reads)."""
    episode = (meta or {}).get("episode") or {}
    total = float(sum(episode.get("rewards", [])))
    return {"score": 0.0, "acc": float(total > 0), "env_reward": total}
