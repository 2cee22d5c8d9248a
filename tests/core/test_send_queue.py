"""The trainer's send queue (decoupled weight updates of the separate rollout): one replica
that is busy holds neither the other replica nor the trainer, at most ``max_in_flight``
snapshots are undelivered, and a failed send is reported naming the replica."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from geartrain.cluster.send_queue import SendQueue
from geartrain.cluster.update_group import UpdateGroup

#: a hang guard only (a broken queue would block the test forever): far above any wait here on a
#: loaded machine, so the order of events, not this bound, decides each test
HANG_GUARD_S = 300.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("w", torch.randn(6, 4, generator=g)), ("b", torch.randn(3, generator=g).bfloat16())]


def test_a_busy_replica_holds_neither_the_other_replica_nor_the_trainer() -> None:
    """Replica 1 does not take any snapshot until released; meanwhile replica 0 receives
    all three, bitwise, over its own gloo group, and the trainer queued all three."""
    ports = [_port(), _port()]
    release = threading.Event()
    received: dict[int, list[list[tuple[str, torch.Tensor]]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    finished = [threading.Event(), threading.Event()]

    def replica(r: int) -> None:
        try:
            group = UpdateGroup("127.0.0.1", ports[r], 1, 2, timeout_s=60)
            for _ in range(3):
                if r == 1:
                    release.wait()  # a long request: it joins no broadcast meanwhile (set in finally)
                received[r].append([(n, t.clone()) for n, t in group.receive()])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            finished[r].set()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    groups = [UpdateGroup("127.0.0.1", p, 0, 2, timeout_s=60) for p in ports]
    sends = SendQueue([lambda tensors, g=g: g.send(iter(tensors), 64) for g in groups], max_in_flight=3)
    try:
        for version in range(3):
            sends.put(_snapshot(version))  # returns at once: 3 may be in flight
        finished[0].wait()  # replica 0 took all three, or its group's timeout_s ended its wait
        assert not errors, errors
        assert len(received[0]) == 3 and received[1] == [], "replica 0 waited for the busy replica 1"
        release.set()
        sends.wait()
    finally:
        release.set()
        sends.close()
        for t in threads:
            t.join()  # no clock of its own: each replica's waits end by its group's timeout_s
    assert not errors, errors
    for r in range(2):
        for version, got in enumerate(received[r]):
            want = _snapshot(version)
            assert [n for n, _ in got] == [n for n, _ in want]
            assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))


def test_at_most_max_in_flight_snapshots_are_undelivered() -> None:
    gate = threading.Semaphore(0)
    delivered: list[int] = []

    def slow(tensors: list[tuple[str, torch.Tensor]]) -> None:
        gate.acquire()
        delivered.append(int(tensors[0][1].item()))

    sends = SendQueue([slow, lambda tensors: None], max_in_flight=2)
    assert sends.put([("v", torch.tensor(0))]) == 1
    assert sends.put([("v", torch.tensor(1))]) == 2
    third = threading.Thread(target=sends.put, args=([("v", torch.tensor(2))],))
    third.start()
    third.join(timeout=0.5)  # a lower bound: on a loaded machine it only makes the check weaker
    assert third.is_alive(), "a third snapshot was queued while two were undelivered"
    gate.release()  # snapshot 0 reaches the slow replica: room for the third
    third.join(timeout=HANG_GUARD_S)
    assert not third.is_alive()
    gate.release()
    gate.release()
    sends.wait()
    sends.close()
    assert delivered == [0, 1, 2]


def test_a_failed_send_is_raised_naming_the_replica() -> None:
    def broken(tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise ConnectionError("peer closed")

    sends = SendQueue([lambda tensors: None, broken], max_in_flight=2)
    sends.put(_snapshot(0))
    with pytest.raises(RuntimeError, match="rollout replica 1 failed: peer closed"):
        sends.wait()
    with pytest.raises(RuntimeError, match="replica 1"):
        sends.put(_snapshot(1))
    sends.close()


def test_a_replaced_replica_gets_only_what_is_sent_after_and_its_old_sender_is_forgotten() -> None:
    """Replica 1 died: its sender is stuck (a send to the dead process) or failed. Replaced,
    the snapshot it had not taken is dropped for it (the trainer does not wait on it), its
    failure is no longer raised, and the new sender gets what is queued for it from now on."""
    entered, stuck, failing = threading.Event(), threading.Event(), threading.Event()
    old: list[int] = []
    new: list[int] = []

    def dead(tensors: list[tuple[str, torch.Tensor]]) -> None:
        old.append(int(tensors[0][1].item()))
        entered.set()
        stuck.wait()  # released at the end: its late failure must not count
        raise ConnectionError("peer closed")

    sends = SendQueue([lambda tensors: None, dead], max_in_flight=1)  # its threads are daemons
    sends.put([("v", torch.tensor(0))])
    assert entered.wait(timeout=HANG_GUARD_S)
    sends.replace(1, lambda tensors: new.append(int(tensors[0][1].item())))
    second = threading.Thread(target=sends.put, args=([("v", torch.tensor(1))], [1]))
    second.start()
    second.join(timeout=HANG_GUARD_S)  # the dead sender stays stuck until the end: waiting on it never ends
    assert not second.is_alive() and not stuck.is_set(), "the trainer waited for the dead replica's snapshot"
    sends.wait()
    assert old == [0] and new == [1]

    def broken(tensors: list[tuple[str, torch.Tensor]]) -> None:
        failing.set()
        raise ConnectionError("peer closed")

    sends.replace(0, broken)
    sends.put([("v", torch.tensor(2))])
    assert failing.wait(timeout=HANG_GUARD_S)
    with pytest.raises(RuntimeError, match="rollout replica 0 failed"):
        sends.wait()
    sends.replace(0, lambda tensors: None)
    stuck.set()  # the first dead sender fails now, after its replacement
    sends.put([("v", torch.tensor(3))])
    sends.wait()  # neither old failure is raised
    assert new == [1, 2, 3]
    sends.close()
