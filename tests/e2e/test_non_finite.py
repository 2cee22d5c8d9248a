"""A policy that stops being finite ends the run with one line and exit 2, whatever the CPU's
rounding makes of an overflowing update (issue 39). Each route is driven on purpose by an
extension plugin that wraps the FSDP engine's hooks (the real engine, the real torch
rollout, the tiny model):

* gradients that become non-finite: every optimizer step is skipped, the watchdog stops;
* weights that stay finite but overflow the logits: the rollout's log-probs are NaN, the
  rollout batch refuses them (never an out-of-range token index);
* weights that are not finite: the weight sync refuses to publish them, naming the weight
  (full weights and the LoRA adapter-only sync alike).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_helpers import JOB_HANG_GUARD_S, MAIN_CONFIG, ROOT, rl_records, run_geartrain
from geartrain.testing.runs import file_tree
from geartrain.trainer.rundir import SET_ASIDE

pytestmark = pytest.mark.e2e

LORA_CONFIG = ROOT / "examples" / "arithmetic" / "grpo_lora.toml"


def _backend(name: str):  # noqa: ANN202
    missing = importlib.util.find_spec(name) is None
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"{name} is not installed in this suite"))


#: each rollout reports a policy that stopped being finite the same way (the SGLang run is
#: in the SGLang suite's environment: make test-sglang-e2e)
BACKENDS = ["torch", _backend("vllm"), _backend("sglang")]

TINY = [
    "sft.enabled=false",
    "trainer.total_steps=4",
    "trainer.save_every=1",
    "trainer.plot=false",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "data.batch_size=4",
    "sampling.n=4",
    "validation.max_prompts=8",
    "validation.every_n_steps=0",
    "watchdog.max_skipped_steps=2",
]

PLUGINS = Path(__file__).with_name("non_finite_plugins.py")


def _train(config: Path, out: Path, *overrides: str, kind: str | None = None) -> tuple[int, str]:
    """``geartrain train`` in a process of its own (with the extension ``kind`` of
    non_finite_plugins.py enabled): its exit code and its standard error."""
    if kind is None:
        proc = run_geartrain("train", str(config), *TINY, f"trainer.output_dir={out}", *overrides)
    else:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.run(
            [sys.executable, str(PLUGINS), kind, str(config), *TINY, f"trainer.output_dir={out}", *overrides],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=JOB_HANG_GUARD_S,
        )
    return proc.returncode, proc.stderr


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_that_become_non_finite_stop_the_run(tmp_path: Path, backend: str) -> None:
    rc, stderr = _train(MAIN_CONFIG, tmp_path / "run", f"rollout.backend={backend}", kind="nan_gradients")
    line = _error_line(stderr)
    assert rc == 2
    assert "step 2: the last 2 steps skipped every optimizer step because the gradient was not finite" in line
    assert [r["actor/skipped"] for r in rl_records(tmp_path / "run" / "metrics.jsonl")[1:]] == [1.0, 1.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_that_overflow_the_logits_stop_the_run(tmp_path: Path, backend: str) -> None:
    rc, stderr = _train(MAIN_CONFIG, tmp_path / "run", f"rollout.backend={backend}", kind="huge_final_norm")
    line = _error_line(stderr)
    assert rc == 2
    assert "step 2: the policy's logits are not finite (NaN or inf) in 16 of 16 generated rows" in line
    assert "lower actor.engine.optim.lr" in line and "the newest checkpoint (step 1) is kept" in line
    assert [r["step"] for r in rl_records(tmp_path / "run" / "metrics.jsonl")] == [0, 1]
    assert (tmp_path / "run" / "checkpoints" / "actor" / "step_00000001" / "MANIFEST.json").is_file()


def test_non_finite_weights_are_never_published(tmp_path: Path) -> None:
    rc, stderr = _train(MAIN_CONFIG, tmp_path / "run", kind="nan_weight")
    line = _error_line(stderr)
    assert rc == 2
    assert "step 2: the policy's weight model.layers.0.mlp.up_proj.weight holds NaN or infinite values" in line
    assert "so it was not published" in line


def test_a_non_finite_adapter_is_never_published(tmp_path: Path) -> None:
    rc, stderr = _train(
        LORA_CONFIG,
        tmp_path / "run",
        "actor.lora.sync=adapter",
        kind="nan_adapter",
    )
    line = _error_line(stderr)
    assert rc == 2
    assert "step 2: the policy's weight base_model.model.model.layers.0.self_attn.q_proj.lora_B" in line, line
    assert "holds NaN or infinite values" in line


def test_an_lr_that_overflows_stops_with_one_line_on_any_cpu(tmp_path: Path) -> None:
    """The issue's probe itself: whichever route this CPU's rounding takes, one line, exit 2.
    The reward differs between samples even for the untrained tiny model (which never gets
    an addition right), so the advantages are not zero and the update happens."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response))\n")
    rc, stderr = _train(MAIN_CONFIG, tmp_path / "run", "actor.engine.optim.lr=1e37", f"reward.function={reward}:score")
    line = _error_line(stderr)
    assert rc == 2
    assert (
        "skipped every optimizer step" in line
        or "logits are not finite" in line
        or "holds NaN or infinite values" in line
    ), line
    assert "actor.engine.optim.lr" in line


def test_a_starting_model_with_a_nan_weight_is_named_not_the_learning_rate(tmp_path: Path) -> None:
    """Rerun of issue 35's item 10 on another source: an HF model directory with a NaN
    weight, trained from (no update yet, no resume), was blamed on the learning rate."""
    from geartrain.config import ModelConfig
    from geartrain.modeling import build_hf_model
    from geartrain.testing.tiny import tiny_tokenizer

    model = tmp_path / "model"
    module = build_hf_model(ModelConfig(tiny="qwen2", config_overrides={"hidden_size": 32, "num_hidden_layers": 1}))
    with torch.no_grad():
        module.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    module.save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    # and with --overwrite over a previous run: it was deleted before step 0 found the
    # NaN; now it is set aside and put back, byte for byte (probes rerun, issue 35)
    out = tmp_path / "run"
    previous = {
        "config.json": b'{"trainer": {}, "actor": {}}',  # a run's (a model's config.json is refused)
        "metrics.jsonl": b'{"step": 2}\n',
        "checkpoints/actor/step_2/state.bin": b"x" * 64,
    }
    for name, data in previous.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    before = file_tree(out)
    rc, stderr = _train(
        MAIN_CONFIG, out, f"model.path={model}", "model.tiny=null", "model.config_overrides={}", "--overwrite"
    )
    after = {name: digest for name, digest in file_tree(out).items() if not name.startswith(("logs/", ".geartrain"))}
    assert after == before and not (out / SET_ASIDE).exists(), sorted(after)
    line = _error_line(stderr)
    assert rc == 2
    assert "step 0: the policy's weight model.layers.0.mlp.down_proj.weight holds NaN" in line, line
    assert "No update has run yet: the model the run starts from holds such weights (model.path" in line, line
    assert "optim.lr; after --resume" not in line, line
