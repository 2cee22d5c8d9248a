"""Issue 35, item 12: a rank that does not finish start-up in time is reported with the
setting that bounds start-up, ``cluster.startup_timeout_s`` (the message named
``cluster.call_timeout_s.step`` and said "during where")."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.cluster.ray_placement import RankFailure, RankPool, deadline_reason, deadline_setting


@pytest.mark.parametrize("method", ["where", "rendezvous_address", "init_distributed", "init_alone"])
def test_a_start_up_call_past_its_deadline_names_startup_timeout_s(tmp_path: Path, method: str) -> None:
    reason = deadline_reason(120.0, method)
    assert reason.startswith("it did not answer within the 120 s deadline of this phase (cluster.startup_timeout_s)")
    pool = RankPool.__new__(RankPool)  # the message alone: no Ray needed
    pool.name, pool.size = "actor", 1
    pool.where = [{"host": "node-a", "node_id": "0123456789abcdef", "pid": 7}]
    pool.log_paths = [str(tmp_path / "actor-rank0.log")]
    (tmp_path / "actor-rank0.log").write_text("loading\n")
    with pytest.raises(RankFailure) as info:
        pool._no_answer([0], "(start-up)", method, reason)
    text = str(info.value)
    assert " did not answer during start-up (" in text and f"during {method}:" not in text, text
    assert "cluster.startup_timeout_s" in text and "call_timeout_s" not in text, text


@pytest.mark.parametrize(
    ("method", "setting"),
    [
        ("step", "cluster.call_timeout_s.step"),
        ("build", "cluster.call_timeout_s.build"),
        ("save_checkpoint", "cluster.call_timeout_s.checkpoint"),
    ],
)
def test_other_calls_name_their_phase(method: str, setting: str) -> None:
    assert deadline_setting(method) == setting


def test_a_rank_whose_process_never_started_is_not_said_to_have_a_heartbeat(tmp_path: Path) -> None:
    """Past the start-up deadline with no beat file, the message says the process had not
    started (seen beside a CPU hog: Ray took over 120 s to start a rank), not that its
    heartbeat goes on."""
    from geartrain.cluster.ray_placement import _Heartbeats

    beats = _Heartbeats([str(tmp_path / "actor-rank0.beat"), str(tmp_path / "actor-rank1.beat")])
    (tmp_path / "actor-rank1.beat").touch()
    assert not beats.has_beaten(0) and beats.has_beaten(1)
    never = deadline_reason(600.0, "where", started=False)
    assert "its process had not started" in never and "heartbeat goes on" not in never, never
    assert "cluster.startup_timeout_s" in never
    assert "heartbeat goes on" in deadline_reason(600.0, "where")


def test_a_rank_that_never_started_is_named_without_question_marks_or_a_log_to_read(tmp_path: Path) -> None:
    """Probes rerun (issue 35): past the start-up deadline a rank whose process never started
    was named 'on node ? (Ray node ?, pid ?)' with the tail of a log file that did not exist."""
    pool = RankPool.__new__(RankPool)
    pool.name, pool.size = "actor", 2
    pool.where = [{"host": "?", "node_id": "?"}, {"host": "node-a", "node_id": "0123456789abcdef", "pid": 7}]
    pool.log_paths = [str(tmp_path / "actor-rank0.log"), str(tmp_path / "actor-rank1.log")]
    (tmp_path / "actor-rank1.log").write_text("importing torch\n")
    with pytest.raises(RankFailure) as info:
        pool._no_answer([0, 1], "(start-up)", "where", deadline_reason(600.0, "where", started=False))
    never, started = str(info.value).split("\n", 1)
    assert "?" not in never and "whose process never reported where it runs" in never, never
    assert f"its log {tmp_path / 'actor-rank0.log'} does not exist yet (the process never started)" in never, never
    assert "on node node-a (Ray node 0123456789ab, pid 7)" in started and "| importing torch" in started, started
