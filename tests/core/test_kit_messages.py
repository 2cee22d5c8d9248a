"""A conformance kit's failure says which contract item failed and what to check (issue 34,
item 19), instead of a bare assert or "Tensor-likes are not close!"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from geartrain.testing.engine_suite import EngineConformance
from geartrain.testing.guard import StandardSuite
from geartrain.testing.rollout_suite import RolloutConformance

ROOT = Path(__file__).resolve().parents[2]

#: The tutorial's engine with one contract broken as docs/plugins.md's example once broke it:
#: forward_backward's outputs concatenated micro-batch after micro-batch, so rows grouped by
#: plan_micro_batches (not consecutive) come back out of order.
AUTHOR_TESTS = f"""
import sys
import types

sys.path.insert(0, {str(ROOT / "tests" / "third_party_plugin" / "src")!r})
import geartrain
from geartrain_simple import plugin as simple
from geartrain.micro_batches import plan_micro_batches
from geartrain.testing.engine_suite import EngineConformance

broken = types.ModuleType("broken_engine")
for name in dir(simple):
    setattr(broken, name, getattr(simple, name))


@geartrain.hookimpl
def forward_backward(model, batch, loss_fn, forward_only):
    out = simple.forward_backward(model, batch, loss_fn, forward_only)
    lengths = batch["attention_mask"].sum(-1).tolist()
    pieces = [row for rows in plan_micro_batches(lengths, model.config.max_tokens_per_micro_batch) for row in rows]
    return geartrain.StepOutput(outputs={{k: v[pieces] for k, v in out.outputs.items()}}, metrics=out.metrics)


broken.forward_backward = forward_backward
geartrain.register_engine("broken", broken)


class TestBrokenEngine(EngineConformance):
    backend = "broken"
    families = ("qwen2",)
"""


def test_a_kit_failure_names_the_contract_item_and_what_to_check(tmp_path: Path) -> None:
    (tmp_path / "test_author.py").write_text(AUTHOR_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_outputs_follow_the_batch_order"]
    proc = subprocess.run([*cmd, str(tmp_path / "test_author.py")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "conformance: test_outputs_follow_the_batch_order failed." in out, out[-3000:]
    assert (
        "contract: forward_backward returns its per-token outputs for the whole batch in the batch's row order" in out
    )
    assert "check: micro-batching: plan_micro_batches groups rows that are not consecutive" in out
    assert "Tensor-likes are not close!" in out  # the comparison's own message follows


@pytest.mark.parametrize("suite", [EngineConformance, RolloutConformance], ids=lambda s: s.__name__)
def test_every_standard_test_has_a_contract_item_and_a_check(suite: type[StandardSuite]) -> None:
    tests = sorted(name for name in vars(suite) if name.startswith("test_"))
    assert tests and sorted(suite.contract_items) == tests
    for name in tests:
        contract, check = suite.contract_items[name]
        assert len(contract.split()) >= 6 and len(check.split()) >= 4, name
        assert getattr(suite, name).__wrapped__.__name__ == name  # explained in place, inherited as is


def test_a_suite_without_a_contract_item_for_a_test_is_refused() -> None:
    with pytest.raises(TypeError, match=r"contract_items has no entry for \['test_b'\]"):

        class Suite(StandardSuite):
            _standard_suite = True
            contract_items: ClassVar[dict[str, tuple[str, str]]] = {"test_a": ("a", "b")}

            def test_a(self) -> None: ...

            def test_b(self) -> None: ...


def test_an_explained_failure_keeps_skips_and_errors_as_they_are() -> None:
    class Suite(StandardSuite):
        _standard_suite = True
        contract_items: ClassVar[dict[str, tuple[str, str]]] = {
            "test_close": ("two tensors agree", "the sum"),
            "test_raises": ("it raises", "the check"),
            "test_skips": ("x", "y"),
        }

        def test_close(self) -> None:
            torch.testing.assert_close(torch.zeros(2), torch.ones(2))

        def test_raises(self) -> None:
            with pytest.raises(ValueError):
                pass

        def test_skips(self) -> None:
            pytest.skip("not declared")

    with pytest.raises(AssertionError, match=r"(?s)contract: two tensors agree\n  check: the sum\n.*not close"):
        Suite().test_close()
    with pytest.raises(AssertionError, match=r"(?s)contract: it raises.*DID NOT RAISE"):
        Suite().test_raises()
    with pytest.raises(pytest.skip.Exception):
        Suite().test_skips()
