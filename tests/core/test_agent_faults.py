"""Agent runs under a hostile or unlucky environment (issue 35, items 3 and 7): a huge
observation is cut to the episode's remaining budget before it is tokenized (counted in
``agent/observation_truncated``, said once); an environment's failure is one line naming
where it raised, not a traceback at every step; ``close()`` raising does not fail start-up;
``sys.exit`` in a tool or an environment is reported as such at once, not as a timeout."""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from geartrain import GeartrainError, SamplingParams
from geartrain.agents import Environment, EpisodeRunner, RunnerLimits, StepResult, ToolEnvironment
from geartrain.agents.tools import run_with_timeout
from geartrain.cli import main
from geartrain.testing.tiny import tiny_tokenizer
from scripted_turns import scripted_generate

ROOT = Path(__file__).resolve().parents[2]
GUESS = ROOT / "examples" / "guess_number" / "grpo.toml"
MAX_MODEL_LEN = 128


class Recording:
    """The tiny tokenizer, recording the longest text it was asked to encode (a pass-through)."""

    def __init__(self) -> None:
        self.tok = tiny_tokenizer()
        self.longest = 0

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def _run(factory: Any, model_turns: list[str], tok: Any = None) -> tuple[Any, dict[str, float], Any]:
    tok = tok or Recording()
    runner = EpisodeRunner(
        scripted_generate(tok.tok if isinstance(tok, Recording) else tok, list(model_turns)),
        tok,
        factory,
        RunnerLimits(max_turns=3, max_model_len=MAX_MODEL_LEN),
    )
    (ep,), metrics = runner.run([tok.encode("q=", add_special_tokens=False)], [{"prompt": "q="}], SamplingParams())
    return ep, metrics, runner


# ----------------------------------------------------------------------------- item 3


class Flood(Environment):
    def __init__(self, first: int = 0, then: int = 1_000_000) -> None:
        self.first, self.then = first, then

    def reset(self, task: dict) -> str:
        return "r" * self.first

    def step(self, action: str) -> StepResult:
        return StepResult(observation="x" * self.then)


@pytest.mark.parametrize(("first", "then"), [(0, 1_000_000), (200_000, 0)], ids=["step-1MB", "reset-200k"])
def test_a_huge_observation_is_cut_before_it_is_tokenized(caplog: Any, first: int, then: int) -> None:
    tok = Recording()
    with caplog.at_level(logging.WARNING, logger="geartrain"):
        ep, metrics, runner = _run(lambda: Flood(first, then), ["1", "2", "3"], tok)
    bound = (MAX_MODEL_LEN + 1) * runner._token_chars()  # the budget, in the most characters a token holds
    assert tok.longest <= bound < 100_000, tok.longest
    assert ep.finish == "truncated" and ep.truncated  # as it ended before: the cut part does not fit either
    assert metrics["agent/observation_truncated"] == 1.0
    said = [r.getMessage() for r in caplog.records if "before tokenizing" in r.getMessage()]
    assert len(said) == 1 and f"an observation of {max(first, then)} characters was cut to" in said[0], said


def test_a_tool_returning_100k_characters_is_cut_too() -> None:
    def dump(n: str) -> str:
        """A tool that floods."""
        return "y" * 100_000

    tok = Recording()
    ep, metrics, _ = _run(lambda: ToolEnvironment([dump], call_format="compact", timeout_s=5.0), ["[dump 1]"], tok)
    assert tok.longest < 100_000 and metrics["agent/observation_truncated"] == 1.0 and ep.truncated


# ----------------------------------------------------------------------------- item 7


class Raises(Environment):
    def reset(self, task: dict) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        raise ValueError("the sandbox is gone")


def test_an_environment_failure_is_one_line_naming_where_it_raised(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="geartrain"):
        ep, _, _ = _run(Raises, ["1"])
    assert ep.finish == "error"
    (record,) = [r for r in caplog.records if "environment step raised" in r.getMessage()]
    assert record.exc_info is None and "\n" not in record.getMessage()
    assert f"at {__file__}:" in record.getMessage() and "in step" in record.getMessage()
    assert record.getMessage().endswith("ValueError: the sandbox is gone")


def test_sys_exit_in_an_environment_ends_its_episode_not_the_process() -> None:
    class Exits(Raises):
        def step(self, action: str) -> StepResult:
            sys.exit(3)

    ep, _, _ = _run(Exits, ["1"])
    assert ep.finish == "error" and ep.error == "SystemExit: step called sys.exit(3)"


def test_a_tool_calling_sys_exit_is_reported_as_such_at_once() -> None:
    def leave() -> str:
        sys.exit(4)

    # it was "timed out after 10.0s" once the whole timeout had passed
    ok, result, _ = run_with_timeout(leave, {}, 10.0)
    assert (ok, result) == (False, "SystemExit: the tool called sys.exit(4)")
    ok, result, _ = run_with_timeout(leave, {}, None)  # no timeout: it waited forever
    assert (ok, result) == (False, "SystemExit: the tool called sys.exit(4)")


def test_close_raising_does_not_fail_start_up(tmp_path: Path, capsys: Any) -> None:
    env = tmp_path / "env.py"
    env.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(GUESS.parent)!r})\n"
        "from env import GuessNumber\n"
        "class Leaky(GuessNumber):\n"
        "    def close(self):\n        raise RuntimeError('cannot release the sandbox')\n"
    )
    rc = main(
        [
            "check",
            str(GUESS),
            "--no-plugins",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.agent.environment={env}:Leaky",
            "sft.enabled=false",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Traceback" not in out.err


def test_a_step_that_times_out_is_said_to_time_out_not_to_raise_in_geartrain(caplog: Any) -> None:
    """Rerun of item 7 on a hanging ``step``: the line said "environment step raised at
    .../geartrain/agents/runner.py:516 in _within", blaming the runner's clock."""
    import threading

    release = threading.Event()

    class Hang(Environment):
        def reset(self, task: dict) -> str:
            return ""

        def step(self, action: str) -> StepResult:
            release.wait()  # until the test ends: the runner's timeout is what ends the episode
            return StepResult(observation="late")

    tok = tiny_tokenizer()
    runner = EpisodeRunner(
        scripted_generate(tok, ["1"]),
        tok,
        Hang,
        RunnerLimits(max_turns=3, max_model_len=MAX_MODEL_LEN),
        step_timeout_s=0.2,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="geartrain"):
            (ep,), _ = runner.run([tok.encode("q=", add_special_tokens=False)], [{"prompt": "q="}], SamplingParams())
    finally:
        release.set()
    assert ep.finish == "error"
    (line,) = [r.getMessage() for r in caplog.records if "its episode" in r.getMessage()]
    assert line.startswith("environment step timed out (its episode 0 ends as an error;"), line
    assert "runner.py" not in line and "step took longer than 0.2 s (rollout.agent.step_timeout_s)" in line, line


def test_close_calling_sys_exit_does_not_end_the_job(tmp_path: Path, capsys: Any) -> None:
    """Probe rerun for item 7: an environment whose ``close()`` calls ``sys.exit(3)`` ended
    ``geartrain train`` at start-up (the probe instance's close) with exit 3 and no output."""
    env = tmp_path / "env.py"
    env.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(GUESS.parent)!r})\n"
        "from env import GuessNumber\n"
        "class Leaves(GuessNumber):\n"
        "    def close(self):\n        sys.exit(3)\n"
    )
    rc = main(
        [
            "check",
            str(GUESS),
            "--no-plugins",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.agent.environment={env}:Leaves",
            "sft.enabled=false",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Traceback" not in out.err


def test_a_close_that_hangs_is_bounded_by_the_step_timeout_and_said_once(caplog: Any) -> None:
    """Probe rerun for item 7: ``close()`` sleeping forever hung the job (a 2-step run had
    printed nothing after 100 s). It gets ``step_timeout_s`` like ``reset`` and ``step``, the
    episode ends as it would (here: solved), and it is said once for the runner's two closes
    (the instance it probes at start and the episode's)."""
    import threading

    release = threading.Event()

    class Stuck(Environment):
        def reset(self, task: dict) -> str:
            return ""

        def step(self, action: str) -> StepResult:
            return StepResult(reward=1.0, done=True)

        def close(self) -> None:
            release.wait()  # until the test ends: the runner's timeout is what lets it go on

    tok = tiny_tokenizer()
    runner = EpisodeRunner(
        scripted_generate(tok, ["1"]),
        tok,
        Stuck,
        RunnerLimits(max_turns=3, max_model_len=MAX_MODEL_LEN),
        step_timeout_s=0.2,
    )
    prompt = tok.encode("q=", add_special_tokens=False)
    try:
        with caplog.at_level(logging.WARNING, logger="geartrain"):
            episodes, _ = runner.run([prompt], [{"prompt": "q="}], SamplingParams())
    finally:
        release.set()
    assert [(ep.finish, ep.error) for ep in episodes] == [("done", None)]
    said = [r.getMessage() for r in caplog.records if "close() did not return" in r.getMessage()]
    assert said == [
        "Stuck.close() did not return within 0.2 s (rollout.agent.step_timeout_s): left running, the run "
        "goes on and later closes are not waited for (said once)"
    ], said


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("    async def step(self, action):\n        return StepResult(reward=1.0, done=True)\n", "step is async def"),
        ("    async def reset(self, task):\n        return ''\n", "reset is async def"),
        ("    def step(self, action):\n        yield StepResult(reward=1.0, done=True)\n", "step is a generator"),
    ],
    ids=["async-step", "async-reset", "generator-step"],
)
def test_an_environment_method_that_returns_no_result_is_refused_at_once(
    tmp_path: Path, capsys: Any, method: str, kind: str
) -> None:
    """Probe rerun for item 7: an environment whose ``step`` is ``async def`` ended every
    episode as an error ('step returned coroutine', with 'never awaited' warnings) and a
    2-step job exited 0; the job is refused before it starts, naming the method."""
    env = tmp_path / "env.py"
    env.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(GUESS.parent)!r})\n"
        "from env import GuessNumber\n"
        "from geartrain.agents import StepResult\n"
        f"class Odd(GuessNumber):\n{method}"
    )
    rc = main(
        [
            "check",
            str(GUESS),
            "--no-plugins",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.agent.environment={env}:Odd",
            "sft.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"rollout.agent.environment = '{env}:Odd': Odd.{kind}; geartrain calls an environment's methods" in err, err
    assert "make it a plain def" in err and "Traceback" not in err


@pytest.mark.parametrize("opening", [False, True], ids=["bridge", "opening"])
def test_a_chat_template_that_fails_is_one_error_naming_the_setting(tmp_path: Path, opening: bool) -> None:
    """Probe rerun for issue 35 items 1 and 7 (probes3): an agent job with
    rollout.agent.chat_template = true on a model whose chat_template.jinja reaches for
    ``os.system`` ran no code (jinja's sandbox) but ended in a 79-line SecurityError
    traceback from the rank, exit 1. Now a GeartrainError (one line, exit 2) naming the fix."""
    from geartrain.agents import chat_bridge
    from geartrain.agents.formats import chat_opening
    from geartrain.errors import GeartrainError

    tok = tiny_tokenizer()
    tok.chat_template = "{{ cycler.__init__.__globals__.os.system('touch " + str(tmp_path / "PWNED") + "') }}"
    with pytest.raises(GeartrainError) as info:
        (chat_opening if opening else chat_bridge)(tok, ["observation"])
    assert str(info.value) == (
        "the tokenizer's chat template failed (SecurityError: access to attribute '__init__' of 'type' object is "
        "unsafe.); fix the template (chat_template.jinja or tokenizer_config.json of the model), or set "
        "rollout.agent.chat_template = false to append observations as plain text"
    )
    assert not (tmp_path / "PWNED").exists()


def test_a_base_exception_in_an_environment_ends_its_episode_not_the_process() -> None:
    """Probe rerun for issue 35 item 7 (probes3): a step raising a BaseException that is not
    an Exception (asyncio's CancelledError from an environment's own event loop, a library's
    own) killed the rank with a 66-line traceback, exit 1; a final_reward calling sys.exit
    went the same way. Each now ends its episode as an error."""
    import asyncio

    class Cancelled(Raises):
        def step(self, action: str) -> StepResult:
            raise asyncio.CancelledError("the sandbox's loop was closed")

    ep, _, _ = _run(Cancelled, ["1"])
    assert ep.finish == "error" and ep.error == "CancelledError: the sandbox's loop was closed"

    class ExitsScoring(Raises):
        def step(self, action: str) -> StepResult:
            return StepResult(observation=None, done=True)

        def final_reward(self) -> float:
            sys.exit(5)

    ep, _, _ = _run(ExitsScoring, ["1"])
    assert ep.finish == "error" and ep.error == "SystemExit: 5"


@pytest.mark.parametrize(
    ("template", "said"),
    [
        (
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Only user and assistant roles are "
            "supported!') }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}",
            "rollout.agent.chat_template: the tokenizer's chat template failed (TemplateError: Only user and "
            "assistant roles are supported!); fix the template",
        ),
        (
            None,
            "rollout.agent.chat_template: rollout.agent.chat_template = true renders observations with the "
            "tokenizer's chat template, and this tokenizer has none; set rollout.agent.chat_template = false",
        ),
    ],
    ids=["refuses the tool role", "no template"],
)
def test_check_renders_an_agent_jobs_chat_template_as_the_episodes_do(
    tmp_path: Path, capsys: Any, template: str | None, said: str
) -> None:
    """Probe 1b/9d left by probes3: ``geartrain check`` passed an agent job whose chat
    template cannot render an observation turn (many templates refuse roles other than
    user and assistant), which ``train`` then refused only after an --overwrite had set
    the previous run aside. Check (and train's preflight) now render one observation."""
    tok = tiny_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    if template is None:
        (tmp_path / "tok" / "chat_template.jinja").unlink(missing_ok=True)
    rc = main(
        [
            "check",
            str(GUESS),
            "--no-plugins",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.tokenizer={tmp_path / 'tok'}",
            "rollout.agent.chat_template=true",
            "sft.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert said in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- probes5


class _BrokenMessage(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


class _BrokenResult:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _raise_broken() -> str:
    raise _BrokenMessage


@pytest.mark.parametrize(
    ("result", "shown"),
    [
        (lambda: b"caf\xff!".decode("utf-8", "surrogateescape"), "(caf\ufffd!)"),
        (_raise_broken, "(error: _BrokenMessage: <_BrokenMessage whose str() raised RuntimeError>)"),
        (_BrokenResult, "(error: RuntimeError: no text)"),
    ],
    ids=["not-utf8", "exception-str-raises", "result-str-raises"],
)
def test_a_tool_whose_output_is_no_text_is_an_observation_not_a_failed_run(
    caplog: Any, result: Any, shown: str
) -> None:
    """Probe rerun for issue 35 items 3 and 7 (probes5), on examples/calculator's path: a tool
    returning bytes decoded with ``errors="surrogateescape"`` (a program's output, a file name
    that is not UTF-8) crashed the run in the tokenizer (60 lines, exit 1); a tool raising an
    exception whose ``__str__`` raises printed a thread traceback per call (11627 lines) and
    ended every episode with ``IndexError``; a result whose ``__str__`` raises ended every
    episode as an environment error. Each is now the call's observation, and the episode goes on."""

    def t(x: str) -> Any:
        """A tool."""
        return result()

    with caplog.at_level(logging.WARNING, logger="geartrain"):
        ep, _, _ = _run(lambda: ToolEnvironment([t], call_format="compact", timeout_s=5.0), ["[t 1]", "done"])
    assert ep.error is None and ep.finish == "done"
    (obs,) = [s for s in ep.segments if s.kind == "observation"]
    assert obs.text == shown
    said = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(said) == (1 if "\ufffd" in shown else 0)


@pytest.mark.parametrize("stops", ["[']', 5]", "'</tool_call>'"], ids=["a-number", "a-bare-string"])
def test_stop_texts_that_are_not_a_list_of_strings_are_refused_by_check_and_the_runner(
    tmp_path: Path, capsys: Any, stops: str
) -> None:
    """Probe rerun for issue 35 item 7 (probes5): an environment whose ``stop_texts`` held a
    number passed ``geartrain check``; ``train`` then died in the tokenizer on the rank
    (53 lines, exit 1). A bare string was read as a list of one-character stop texts: each
    turn would end at its first ``t``. Both are one line naming the class, in check and run."""
    env = tmp_path / "env.py"
    env.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(GUESS.parent)!r})\n"
        "from env import GuessNumber\n"
        f"class Stops(GuessNumber):\n    stop_texts = {stops}\n"
    )
    rc = main(
        [
            "check",
            str(GUESS),
            "--no-plugins",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.agent.environment={env}:Stops",
            "sft.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    said = f"Stops.stop_texts must be a list of strings (the texts that end a model turn), got {stops}"
    assert f"rollout.agent.environment: {said}" in err, err

    class Stops(Raises):
        stop_texts = ast.literal_eval(stops)

    with pytest.raises(GeartrainError, match=r"^Stops\.stop_texts must be a list of strings"):
        _run(Stops, ["1"])


def test_an_environment_reward_past_the_largest_float_ends_its_episode_not_the_run() -> None:
    """Probe rerun for issue 35 item 7 (probes5): ``StepResult.reward = 10**400`` raised
    OverflowError out of the runner (54 lines from the rank, exit 1); ``10**5000`` would
    have raised in the message's repr. Each ends its episode as an environment error."""

    class Huge(Raises):
        def __init__(self, reward: int) -> None:
            self.reward = reward

        def step(self, action: str) -> StepResult:
            return StepResult(reward=self.reward, done=True)

    ep, _, _ = _run(lambda: Huge(10**400), ["1"])
    assert (
        ep.finish == "error"
        and ep.error.startswith("StepResult.reward is 1000")
        and ep.error.endswith("..., not a finite number")
    )
    ep, _, _ = _run(lambda: Huge(10**5000), ["1"])
    assert ep.error == "StepResult.reward is <int whose repr() raised ValueError>, not a finite number"


def test_a_chat_template_raising_a_python_error_is_one_error_naming_the_setting() -> None:
    """Probe rerun for issue 35 item 7 (probes5): a template whose expression raises a Python
    error as it renders (``{{ 1/0 }}``) was not caught as jinja's TemplateError is: a traceback."""
    from geartrain.agents import chat_bridge
    from geartrain.errors import GeartrainError

    tok = tiny_tokenizer()
    tok.chat_template = "{{ messages | length / 0 }}"
    with pytest.raises(GeartrainError, match=r"^the tokenizer's chat template failed \(ZeroDivisionError: division"):
        chat_bridge(tok, ["observation"])


def test_a_tool_no_call_can_name_is_refused_when_the_environment_is_built() -> None:
    """Issue 35, round 12: ``ToolEnvironment([lambda e: "1"])`` was accepted; its tool was
    named '<lambda>', so every call the model made failed ("unknown tool")."""
    with pytest.raises(GeartrainError, match="a tool is named '<lambda>', which no tool call can name"):
        ToolEnvironment([lambda expression: "1"])

    def get_weather(city: str) -> str:
        return "sunny"

    assert list(ToolEnvironment([get_weather]).registry) == ["get_weather"]
