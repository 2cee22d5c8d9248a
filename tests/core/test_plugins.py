"""Plugin discovery, validation, dispatch and the errors a user sees.

The plugins here are *fake* on purpose: they test the core's plumbing (discovery through
real ``importlib.metadata`` distributions, validation, one backend per manager), not any
compute. Real engines are tested with the conformance suites.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import geartrain
import pytest
from geartrain import plugins
from geartrain.errors import PluginError, PluginNotFoundError

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600

REQUIRED_ENGINE = "\n".join(
    f"@hookimpl\ndef {hook}({args}):\n    return {ret!r}\n"
    for hook, args, ret in [
        ("build_model", "config, ctx", None),
        ("shard", "module, config, ctx", "fake-handle"),
        ("forward_backward", "model, batch, loss_fn, forward_only", "fake-fb"),
        ("optimizer_step", "model", {"grad_norm": 0.0, "lr": 0.0, "skipped": 0.0}),
        ("reshard_for_rollout", "model, rollout", None),
        ("save_checkpoint", "model, path, extra", None),
        ("load_checkpoint", "model, path", {}),
    ]
)
HEADER = "from geartrain import hookimpl\n"


def fake_engine(tag: str, extra: str = "", drop: str | None = None) -> str:
    body = REQUIRED_ENGINE.replace("fake-fb", f"fb-from-{tag}")
    if drop:
        start = body.index(f"@hookimpl\ndef {drop}(")
        end = body.index("@hookimpl", start + 1) if "@hookimpl" in body[start + 1 :] else len(body)
        body = body[:start] + body[end:]
    return HEADER + body + extra


def test_torch_rollout_is_registered_through_the_core_entry_point() -> None:
    info = plugins.backend_info("rollout", "torch")
    assert info.distribution == "geartrain"
    assert info.version == geartrain.__version__
    assert set(plugins.REQUIRED_HOOKS["rollout"]) <= set(info.hooks)


def test_an_installed_engine_is_discovered_and_dispatched(installed) -> None:
    installed(
        "gtfake-alpha",
        "1.2.3",
        {"gtfake_alpha": fake_engine("alpha")},
        {"geartrain.engines": {"alpha": "gtfake_alpha"}},
    )
    info = plugins.backend_info("engine", "alpha")
    assert (info.distribution, info.version, info.source) == ("gtfake-alpha", "1.2.3", "entry-point")
    pm = plugins.create_manager("engine", "alpha")
    assert pm.hook.forward_backward(model=None, batch=None, loss_fn=None, forward_only=True) == "fb-from-alpha"


def test_each_manager_holds_exactly_one_backend(installed) -> None:
    installed("gtfake-a", "1.0", {"gtfake_a": fake_engine("a")}, {"geartrain.engines": {"a": "gtfake_a"}})
    installed("gtfake-b", "1.0", {"gtfake_b": fake_engine("b")}, {"geartrain.engines": {"b": "gtfake_b"}})
    pm_a, pm_b = plugins.create_manager("engine", "a"), plugins.create_manager("engine", "b")
    call = dict(model=None, batch=None, loss_fn=None, forward_only=True)
    assert pm_a.hook.forward_backward(**call) == "fb-from-a"
    assert pm_b.hook.forward_backward(**call) == "fb-from-b"
    assert len(pm_a.get_plugins()) == 1 and len(pm_b.get_plugins()) == 1


def test_an_extension_wraps_a_hook(installed) -> None:
    extension = (
        HEADER
        + """
calls = []

@hookimpl(wrapper=True)
def forward_backward(model, batch, loss_fn, forward_only):
    calls.append("before")
    result = yield
    calls.append("after")
    return result + "+wrapped"
"""
    )
    installed("gtfake-eng", "1.0", {"gtfake_eng": fake_engine("eng")}, {"geartrain.engines": {"eng": "gtfake_eng"}})
    installed("gtfake-ext", "0.1", {"gtfake_ext": extension}, {"geartrain.extensions": {"trace": "gtfake_ext"}})
    pm = plugins.create_manager("engine", "eng", ["trace"])
    assert pm.hook.forward_backward(model=None, batch=None, loss_fn=None, forward_only=True) == "fb-from-eng+wrapped"
    assert sys.modules["gtfake_ext"].calls == ["before", "after"]


@pytest.mark.parametrize(
    ("module", "expected", "fix"),
    [
        (
            "import gtfake_not_installed_dependency\n",
            "failed to import gtfake_broken: ModuleNotFoundError: No module named 'gtfake_not_installed_dependency'",
            "pip install --force-reinstall gtfake-broken",
        ),
        (  # probes7: sys.exit at import ended `geartrain plugins` with exit 3 and no output
            "import sys\nsys.exit(3)\n",
            "failed to import gtfake_broken: SystemExit: 3",
            "its module raised: a bug in the plugin, or code for another Python or geartrain version; upgrade it "
            "(pip install --upgrade gtfake-broken) or tell its authors",
        ),
        (  # issue 35 round 10: code that does not parse was told to reinstall the plugin
            "def broken(:\n",
            "failed to import gtfake_broken: SyntaxError: invalid syntax",
            f"its code does not parse on Python {sys.version_info.major}.{sys.version_info.minor}: a bug in the "
            "plugin, or code for another Python or geartrain version; upgrade it (pip install --upgrade "
            "gtfake-broken) or tell its authors; or leave it out with GEARTRAIN_PLUGINS=<names to load>",
        ),
        (
            fake_engine("x", drop="forward_backward"),
            "does not implement required hook(s): forward_backward",
            "implement them with @geartrain.hookimpl",
        ),
        (
            fake_engine("x", drop="optimizer_step")
            + "\n@hookimpl\ndef optimizer_step(model, learning_rate):\n    return {}\n",
            "does not match the spec optimizer_step(model)",
            "name the hook's arguments as the spec does",
        ),
        (
            fake_engine("x") + "\n@hookimpl\ndef forward_backwards(model):\n    return None\n",
            "implements 'forward_backwards', which is not a geartrain hook",
            "fix the hook name",
        ),
    ],
    ids=["import-error", "sys-exit", "syntax-error", "missing-hook", "wrong-signature", "unknown-hook"],
)
def test_a_broken_plugin_gets_one_clear_error_and_spares_the_others(installed, module, expected, fix) -> None:
    installed("gtfake-broken", "0.0.7", {"gtfake_broken": module}, {"geartrain.engines": {"broken": "gtfake_broken"}})
    installed(
        "gtfake-good", "2.0", {"gtfake_good": fake_engine("good")}, {"geartrain.engines": {"good": "gtfake_good"}}
    )
    with pytest.raises(PluginError) as err:
        plugins.create_manager("engine", "broken")
    text = str(err.value)
    assert "engine plugin 'broken' (distribution gtfake-broken 0.0.7)" in text
    assert expected in text
    assert fix in text
    listed = {i.name: i for i in plugins.list_plugins()}
    assert listed["broken"].error == text
    assert listed["good"].error is None and listed["torch"].error is None
    plugins.create_manager("engine", "good")  # still loads


def test_a_name_two_distributions_register_is_refused_naming_both(installed) -> None:
    """Probes7 (issue 35): two installed distributions with an engine entry point of the same
    name (or a third party's 'torch' rollout beside geartrain's) were resolved silently, to
    whichever the import system listed last: an order of sys.path and directory listings. The
    name is refused naming every distribution; other names and code registration still work."""
    for dist in ("gtfake-one", "gtfake-two"):
        module = dist.replace("-", "_")
        installed(dist, "1.0", {module: fake_engine("same")}, {"geartrain.engines": {"same": module}})
    installed("gtfake-shadow", "3.1", {"gtfake_shadow": "x = 1\n"}, {"geartrain.rollouts": {"torch": "gtfake_shadow"}})
    installed(
        "gtfake-good", "2.0", {"gtfake_good": fake_engine("good")}, {"geartrain.engines": {"good": "gtfake_good"}}
    )
    with pytest.raises(PluginError) as err:
        plugins.create_manager("engine", "same")
    text = str(err.value)
    assert text.startswith("engine plugin 'same': 2 installed distributions register this name: ")
    assert "gtfake-one 1.0 (gtfake_one)" in text and "gtfake-two 1.0 (gtfake_two)" in text
    assert "fix: uninstall all but one (pip uninstall <distribution>)" in text
    assert "gtfake_one" not in sys.modules and "gtfake_two" not in sys.modules  # neither was imported
    with pytest.raises(PluginError, match=r"gtfake-shadow 3\.1 \(gtfake_shadow\).*geartrain does not pick one"):
        plugins.create_manager("rollout", "torch")
    listed = {(i.kind, i.name): i for i in plugins.list_plugins()}
    assert listed[("engine", "same")].error == text and listed[("engine", "good")].error is None
    plugins.create_manager("engine", "good")
    import gtfake_one

    plugins.register_engine("same", gtfake_one)  # the way to pick one without uninstalling
    try:
        plugins.create_manager("engine", "same")
    finally:
        plugins.unregister("engine", "same")


def test_asking_for_a_missing_backend_lists_the_installed_ones_and_the_pip_command(installed) -> None:
    installed(
        "gtfake-alpha",
        "1.2.3",
        {"gtfake_alpha": fake_engine("alpha")},
        {"geartrain.engines": {"alpha": "gtfake_alpha"}},
    )
    with pytest.raises(PluginNotFoundError) as err:
        plugins.create_manager("engine", "megatron")
    text = str(err.value)
    assert "no engine named 'megatron'" in text
    assert "alpha (gtfake-alpha 1.2.3)" in text
    assert "Install it with: pip install ./plugins/megatron_engine" in text
    with pytest.raises(PluginNotFoundError, match="register it in code with geartrain.register_engine"):
        plugins.create_manager("engine", "nobody-publishes-this")


def test_allow_list_limits_what_loads(installed, monkeypatch: pytest.MonkeyPatch) -> None:
    installed(
        "gtfake-alpha", "1.0", {"gtfake_alpha": fake_engine("alpha")}, {"geartrain.engines": {"alpha": "gtfake_alpha"}}
    )
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "")
    assert [i for i in plugins.list_plugins() if i.source == "entry-point"] == []
    with pytest.raises(PluginNotFoundError, match="does not allow it") as err:
        plugins.create_manager("rollout", "torch")
    assert "Install it with" not in str(err.value)  # probes7: it is installed; the allow-list keeps it out
    with pytest.raises(PluginNotFoundError, match="does not allow it") as err:
        plugins.create_manager("rollout", "sglang")  # not installed here: how to install it is still said
    assert "Install it with: pip install './plugins/sglang_rollout[gpu]'" in str(err.value)
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "alpha")
    assert {i.name for i in plugins.list_plugins()} == {"alpha"}
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV)
    assert {"alpha", "torch"} <= {i.name for i in plugins.list_plugins()}


def test_allow_list_skips_a_broken_plugin_without_importing_it(installed, monkeypatch: pytest.MonkeyPatch) -> None:
    installed(
        "gtfake-broken",
        "1.0",
        {"gtfake_broken": "raise RuntimeError('boom')\n"},
        {"geartrain.engines": {"broken": "gtfake_broken"}},
    )
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "torch")
    assert [i.name for i in plugins.list_plugins()] == ["torch"]
    assert "gtfake_broken" not in sys.modules


def test_programmatic_registration_and_its_validation() -> None:
    import types

    module = types.ModuleType("gtfake_inline")
    exec(fake_engine("inline"), module.__dict__)  # noqa: S102 - building a module in a test
    geartrain.register_engine("inline", module, distribution="notebook", version="0")
    try:
        pm = plugins.create_manager("engine", "inline")
        assert pm.hook.forward_backward(model=None, batch=None, loss_fn=None, forward_only=True) == "fb-from-inline"
        listed = {i.name: i for i in plugins.list_plugins()}
        assert listed["inline"].source == "registered"
    finally:
        plugins.unregister("engine", "inline")
    incomplete = types.ModuleType("gtfake_incomplete")
    exec(fake_engine("x", drop="shard"), incomplete.__dict__)  # noqa: S102
    with pytest.raises(PluginError, match="does not implement required hook"):
        geartrain.register_engine("incomplete", incomplete)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geartrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, **(env or {})},
    )


def test_cli_lists_plugins_as_json_and_table(installed) -> None:
    site = installed(
        "gtfake-broken",
        "0.0.7",
        {"gtfake_broken": "import gtfake_missing\n"},
        {"geartrain.engines": {"broken": "gtfake_broken"}},
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = _cli("plugins", "--json", env=env)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    torch_row = rows["torch"]
    assert torch_row["kind"] == "rollout" and torch_row["distribution"] == "geartrain"
    assert torch_row["version"] == geartrain.__version__ and torch_row["error"] is None
    assert "generate" in torch_row["hooks"]
    assert "gtfake_missing" in rows["broken"]["error"]
    table = _cli("plugins", env={**env, "COLUMNS": "200"})
    assert table.returncode == 0 and "torch" in table.stdout and "broken" in table.stdout
    none = _cli("plugins", "--json", env={plugins.ALLOW_LIST_ENV: ""})
    assert [r for r in json.loads(none.stdout) if r["source"] == "entry-point"] == []
    # issue 35, round 13: with the variable empty the table said "no plugins installed"
    hidden = _cli("plugins", env={plugins.ALLOW_LIST_ENV: ",,,"})
    assert "no plugins installed" not in hidden.stdout, hidden.stdout
    assert hidden.stderr.strip().splitlines()[-1] == (
        f"note: {plugins.ALLOW_LIST_ENV}=',,,' loads only the plugins it names; unset it to list every installed one"
    )


def test_a_plugin_printing_at_import_leaves_the_json_on_stdout_whole(installed, capsys) -> None:
    """Issue 35 round 9 (probes9): a third-party plugin that prints at import (a banner, a
    debug line) wrote into `geartrain plugins --json`'s stdout ahead of the JSON, which no
    JSON reader could then parse; what a plugin prints at import goes to stderr."""
    from geartrain.cli import main

    installed(
        "gtfake-chatty",
        "0.1",
        {"gtfake_chatty": "print('hello from a chatty plugin')\n" + fake_engine("chatty")},
        {"geartrain.engines": {"chatty": "gtfake_chatty"}},
    )
    assert main(["plugins", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["chatty"]["error"] is None
    assert "hello from a chatty plugin" in err
