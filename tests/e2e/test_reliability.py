"""Issue 10's probes on the real job (FSDP engine, torch rollout, tiny model, a few steps):
a finished run is never wiped, a resume with a changed config lists and refuses or applies
every change, a damaged checkpoint is passed over for the intact one, a run that trains
nothing stops or warns, and a hanging reward function times out."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import pytest
from e2e_helpers import JOB_HANG_GUARD_S, MAIN_CONFIG, rl_records
from geartrain.cli import main
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.watchdog import TrainingStalledError

pytestmark = pytest.mark.e2e

TINY = [
    "sft.enabled=false",
    "trainer.total_steps=2",
    "trainer.save_every=1",
    "trainer.plot=false",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "data.batch_size=4",
    "sampling.n=4",
    "validation.max_prompts=8",
    "validation.every_n_steps=0",
]


def _config(out: Path, *overrides: str):  # noqa: ANN202
    return load_train_config(MAIN_CONFIG, [*TINY, f"trainer.output_dir={out}", *overrides])


@pytest.fixture
def length_reward(tmp_path: Path) -> str:
    """A reward that differs between samples even for the untrained tiny model (which never
    gets an addition right), so the advantages are not zero for want of a signal."""
    path = tmp_path / "length_reward.py"
    path.write_text("def score(response, ground_truth):\n    return float(len(response))\n")
    return f"reward.function={path}:score"


def _tree(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert run_job(_config(out)).steps == 2
    return out


def test_a_fresh_run_into_a_finished_run_refuses_and_keeps_it(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(finished_run)
    assert "checkpoints/actor/step_00000002/MANIFEST.json" in before
    # the probe: a typo in data.path, into a finished run, without --resume
    rc = main(["train", str(MAIN_CONFIG), *TINY, "data.path=data/trian.jsonl", f"trainer.output_dir={finished_run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "already holds a run" in err and "--resume" in err and "--overwrite" in err
    rc = main(
        [
            "train",
            str(MAIN_CONFIG),
            *TINY,
            "data.path=data/trian.jsonl",
            f"trainer.output_dir={finished_run}",
            "--overwrite",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no such data file" in err and "nothing was trained or changed" in err
    assert _tree(finished_run) == before


def test_resume_refuses_a_changed_lr_and_falls_back_from_a_damaged_checkpoint(
    finished_run: Path, tmp_path: Path
) -> None:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    reference = rl_records(out / "metrics.jsonl")
    before = _tree(out)
    with pytest.raises(ConfigError) as err:  # the probe: --resume ... actor.engine.optim.lr=1e-2
        run_job(_config(out, "actor.engine.optim.lr=1e-2", "trainer.total_steps=3"), resume=True)
    assert "actor.engine.optim.lr: 0.0003 -> 0.01: refused" in str(err.value)
    assert "trainer.total_steps: 2 -> 3 (applied" in str(err.value)
    assert _tree(out) == before

    shard = next((out / "checkpoints" / "actor" / "step_00000002" / "dcp").glob("*.distcp"))
    with shard.open("r+b") as fh:  # 4 KB overwritten inside a .distcp file (with other bytes)
        fh.seek(shard.stat().st_size // 2)
        old = fh.read(4096)
        fh.seek(shard.stat().st_size // 2)
        fh.write(bytes(b ^ 0xA5 for b in old))
    said: list[str] = []
    from geartrain.trainer.run import Job

    result = Job(_config(out, "trainer.total_steps=3"), resume=True, echo=said.append).run()
    assert result.steps == 3
    text = "\n".join(said)
    assert f"checkpoint {out / 'checkpoints' / 'actor' / 'step_00000002'} is damaged: dcp/{shard.name}" in text
    assert "falling back to the previous checkpoint" in text and "(step 1)" in text
    assert "trainer.total_steps: 2 -> 3 (applied" in text
    assert "actor.engine.optim.total_steps: 2 -> 3 (applied: the LR schedule's horizon follows" in text  # derived
    records = rl_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss"):  # step 2 redone from step 1: as before
        assert records[2][key] == pytest.approx(reference[2][key], abs=1e-6), key


def test_greedy_sampling_warns_that_nothing_is_learned(
    tmp_path: Path, length_reward: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(
        tmp_path / "run", length_reward, "sampling.temperature=0", "sampling.n=8", "watchdog.zero_advantage_steps=2"
    )
    with caplog.at_level(logging.WARNING, logger="geartrain.watchdog"):
        run_job(config)
    warned = [r.getMessage() for r in caplog.records if r.name == "geartrain.watchdog"]
    assert len(warned) == 1 and "advantages were all zero for the last 2 steps" in warned[0]
    assert "sampling.temperature = 0 makes the 8 samples of a prompt identical" in warned[0]
    assert [r["advantages/abs_mean"] for r in rl_records(tmp_path / "run" / "metrics.jsonl")[1:]] == [0.0, 0.0]


def test_a_job_shorter_than_the_watchdog_streak_that_trained_nothing_fails(tmp_path: Path) -> None:
    """Probes rerun (issue 35): a reward returning 1e300 made a 2-step job skip both
    optimizer steps and exit 0; now it ends with the watchdog's error, naming the reward."""
    reward = tmp_path / "huge.py"
    reward.write_text("def score(response, ground_truth):\n    return 1e300\n")
    with pytest.raises(TrainingStalledError) as err:
        run_job(_config(tmp_path / "run", f"reward.function={reward}:score"))
    assert "all 2 steps of this run (nothing was trained)" in str(err.value), str(err.value)
    assert "the reward scores are not finite" in str(err.value)
    assert [r["actor/skipped"] for r in rl_records(tmp_path / "run" / "metrics.jsonl")[1:]] == [1.0, 1.0]


def test_a_reward_that_always_raises_is_logged_once_and_stops_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A reward that passes the start-up check (its first 4 calls: the check's rows) and
    # raises on every call of the run; one that raises at once is refused before step 1
    # (tests/core/test_reward_contract.py).
    reward = tmp_path / "broken.py"
    reward.write_text(
        "from pathlib import Path\n"
        "CALLS = Path(__file__).with_suffix('.calls')\n"
        "def score(response, ground_truth):\n"
        "    calls = int(CALLS.read_text()) if CALLS.exists() else 0\n"
        "    CALLS.write_text(str(calls + 1))\n"
        "    if calls < 4:\n"
        "        return 0.0\n"
        "    return {'points': 1}['score']\n"
    )
    config = _config(
        tmp_path / "run",
        f"reward.function={reward}:score",
        "trainer.total_steps=5",
        "watchdog.max_failed_reward_steps=2",
    )
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingStalledError, match="for 2 steps in a row"):
        run_job(config)
    tracebacks = [r for r in caplog.records if r.name == "geartrain.rewards" and r.exc_info]
    assert len(tracebacks) == 1 and "KeyError" in tracebacks[0].getMessage()
    watchdog = [r.getMessage() for r in caplog.records if r.name == "geartrain.watchdog"]
    assert len(watchdog) == 1 and "every reward call of step 1 failed" in watchdog[0]
    assert [r["reward/error_fraction"] for r in rl_records(tmp_path / "run" / "metrics.jsonl")[1:]] == [1.0, 1.0]


def test_a_hanging_reward_times_out_and_the_run_goes_on(tmp_path: Path) -> None:
    # the hung calls wait for the test's release (a file), and leave a mark when they return
    release, returned = tmp_path / "release", tmp_path / "returned"
    reward = tmp_path / "hangs.py"
    reward.write_text(
        "import pathlib, time\n"
        f"RELEASE, RETURNED = pathlib.Path({str(release)!r}), pathlib.Path({str(returned)!r})\n"
        "def score(response, ground_truth):\n"
        "    if int(ground_truth) % 2:\n"
        "        while not RELEASE.exists():  # until released (the job's exit ends its daemon thread)\n"
        "            time.sleep(0.1)\n"
        "        RETURNED.touch()\n"
        "    return float(response.strip() == ground_truth)\n"
    )
    config = _config(tmp_path / "run", f"reward.function={reward}:score", "reward.timeout_s=1", "validation.path=null")
    try:
        assert run_job(config).steps == 2
        # the run went on past each hung call while it still hung (an order of events, not a
        # wall-clock limit: a loaded machine cannot fail it; a run that waited for them would)
        assert not returned.exists()
    finally:
        release.touch()
    records = rl_records(tmp_path / "run" / "metrics.jsonl")[1:]
    for record in records:
        assert record["reward/timeouts"] > 0 and record["reward/errors"] >= record["reward/timeouts"]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("manifest", ["empty", "matching"])
def test_resume_never_runs_a_planted_dcp_metadata(finished_run: Path, tmp_path: Path, manifest: str) -> None:
    # issue 24 item 2's probe: a crafted dcp/.metadata, the manifest emptied or rewritten to match
    import json
    import pickle
    import shutil

    from geartrain.errors import CheckpointError
    from geartrain.manifest import MANIFEST, write_manifest

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    marker = tmp_path / "pwned"
    for step in ("step_00000001", "step_00000002"):
        ckpt = out / "checkpoints" / "actor" / step
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        if manifest == "empty":
            (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "files": {}}))
        else:
            write_manifest(ckpt, exclude=frozenset({"COMPLETE"}))
    with pytest.raises(CheckpointError) as err:
        run_job(_config(out, "trainer.total_steps=3"), resume=True)
    assert not marker.exists(), "the payload ran"
    if manifest == "empty":
        assert "every checkpoint under" in str(err.value) and "is damaged" in str(err.value)
    else:
        assert "dcp/.metadata: refusing to load it" in str(err.value) and "not one of DCP's metadata classes" in str(
            err.value
        )


SFT = [
    "sft.enabled=true",
    "sft.steps=2",
    "sft.min_steps=1",
    "sft.dev_path=null",
    "sft.stop_at_accuracy=null",  # no dev set to stop on
    "sft.batch_size=8",
    "trainer.total_steps=1",
]


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two finished 1-step runs with a 2-step SFT warm start each (different seeds)."""
    root = tmp_path_factory.mktemp("sft")
    run_job(_config(root / "a", *SFT))
    run_job(_config(root / "b", *SFT, "sft.seed=7"))
    return root / "a", root / "b"


def test_a_truncated_sft_model_is_named_on_resume(sft_runs: tuple[Path, Path], tmp_path: Path) -> None:
    # issue 24 item 4's probe: a truncated sft_model/ died with a 66-line SafetensorError
    import shutil

    from geartrain.errors import CheckpointError

    out = tmp_path / "run"
    shutil.copytree(sft_runs[0], out)
    weights = out / "sft_model" / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError) as err:
        run_job(_config(out, *SFT, "trainer.total_steps=2"), resume=True)
    message = str(err.value)
    assert "\n" not in message
    assert f"{out / 'sft_model'} (the SFT warm start, this run's reference policy) is damaged" in message
    assert f"model.safetensors has {size // 2} bytes, the manifest says {size}" in message


def test_a_swapped_sft_model_is_refused_on_resume(sft_runs: tuple[Path, Path], tmp_path: Path) -> None:
    # issue 24 item 4's probe: another run's sft_model/ resumed silently (actor/ref_kl x250)
    import shutil

    from geartrain.errors import CheckpointError

    out = tmp_path / "run"
    shutil.copytree(sft_runs[0], out)
    shutil.rmtree(out / "sft_model")
    shutil.copytree(sft_runs[1] / "sft_model", out / "sft_model")  # intact, with its own manifest
    with pytest.raises(CheckpointError, match="is not the SFT warm start checkpoint .* was trained from"):
        run_job(_config(out, *SFT, "trainer.total_steps=2"), resume=True)
    # the run's own warm start resumes
    shutil.rmtree(out / "sft_model")
    shutil.copytree(sft_runs[0] / "sft_model", out / "sft_model")
    assert run_job(_config(out, *SFT, "trainer.total_steps=2"), resume=True).steps == 2


def test_overwrite_into_a_live_run_is_refused_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 24 item 1's probe: `make train`'s --overwrite into out/x while a run trains there
    # deleted that run's files and both ran on, mixing their files
    import os
    import re
    import signal
    import subprocess

    from e2e_helpers import ROOT, geartrain_cmd

    out = tmp_path / "run"
    reward = tmp_path / "slow.py"
    reward.write_text(
        "import time\ndef score(response, ground_truth):\n    time.sleep(0.02)\n    return float(len(response))\n"
    )
    live_args = [*TINY, "trainer.total_steps=200", f"reward.function={reward}:score", f"trainer.output_dir={out}"]
    live = subprocess.Popen(
        geartrain_cmd("train", str(MAIN_CONFIG), *live_args),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + JOB_HANG_GUARD_S  # a hang guard: the run's second step ends the wait
        while not ((out / "metrics.jsonl").exists() and len(rl_records(out / "metrics.jsonl")) >= 2):
            assert live.poll() is None and time.monotonic() < deadline, "the live run did not get going"
            time.sleep(0.2)
        rc = main(["train", str(MAIN_CONFIG), *TINY, f"trainer.output_dir={out}", "--overwrite"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert re.search(
            rf"'{re.escape(str(out))}' is in use by a live run \(pid {live.pid} on host \S+, started .*"
            r"geartrain.* train .*\); nothing was changed",
            err,
        ), err
        assert (out / "checkpoints").is_dir() and live.poll() is None, "the live run lost its files or stopped"
        live.send_signal(signal.SIGKILL)  # the owner dies: its lock is stale now
        live.wait()
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    said: list[str] = []
    from geartrain.trainer.run import Job

    Job(_config(out, "trainer.total_steps=3"), resume=True, echo=said.append).run()
    assert any(f"took over the lock of {out} left by a run that is gone (pid {live.pid} on host" in s for s in said), (
        said
    )
    assert (out / ".geartrain.lock").read_text() == "" and os.path.exists(out / "metrics.jsonl")
