"""Where the streaming separate rollout sends a request: to the replica that can start it
soonest. A replica loads new weights only after the requests sent to it before them, so a
replica with a long sample in flight from before the last weights is passed over; requests
sent after the weights do not delay it (continuous batching), and one not back yet makes
the replica's start unknown (never, for the routing)."""

from __future__ import annotations

from geartrain.trainer.separate import SeparateGeneration, _Request


def _generation(requests: list[list[_Request]], publishes: int) -> SeparateGeneration:
    generation = SeparateGeneration.__new__(SeparateGeneration)  # the routing state only: no replicas
    generation.routed = requests
    generation.publishes = publishes
    return generation


def _request(replica: int, publishes: int, ready: float | None) -> _Request:
    return _Request(number=0, replica=replica, prompts=None, call=None, publishes=publishes, ready=ready)  # type: ignore[arg-type]


def test_a_replica_draining_a_long_sample_before_its_new_weights_is_passed_over() -> None:
    now = 100.0
    generation = _generation(
        [
            [_request(0, publishes=2, ready=now + 5.0)],  # sent before the 3rd weights: they wait for it
            [_request(1, publishes=2, ready=now + 0.5), _request(1, publishes=3, ready=now + 9.0)],
        ],
        publishes=3,
    )
    assert generation._available(0, now) == now + 5.0
    assert generation._available(1, now) == now + 0.5  # the long request came after the weights
    generation.publishes = 4  # newer weights: now they wait for replica 1's long request too
    assert generation._available(1, now) == now + 9.0


def test_a_request_not_back_yet_makes_the_start_unknown_and_finished_ones_are_forgotten() -> None:
    now = 100.0
    generation = _generation(
        [[_request(0, publishes=0, ready=None)], [_request(1, publishes=0, ready=now - 1.0)]], publishes=1
    )
    assert generation._available(0, now) == float("inf")
    assert generation._available(1, now) == now
    assert generation.routed[1] == []  # done before now: no longer tracked
