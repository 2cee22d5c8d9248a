"""The trainer's side of decoupled weight updates: one sender thread per rollout replica,
each over a weight-update group of its own (two members: the trainer and that replica), and
at most ``max_in_flight`` snapshots not yet delivered to every replica.

With one group spanning the trainer and every replica, a broadcast ends only when the
busiest replica has finished its current request and joined it: the other replicas wait
inside the collective and the trainer's next broadcast waits for the previous one, so the
replicas are re-synchronised after every update. Here each replica takes each snapshot
when it is ready, in order; a replica's long request holds only that replica's sender, and
the trainer blocks only when ``max_in_flight`` snapshots are still on their way (the
separate rollout uses ``algorithm.max_staleness + 1``: a replica further behind could
only produce samples too stale to train on).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: sends one snapshot (``(name, tensor)`` pairs) to one replica; raises on failure
Send = Callable[[list[tuple[str, torch.Tensor]]], Any]


class _Delivery:
    """One snapshot on its way to the replicas ``receivers``."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], receivers: Sequence[int]) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] | None = tensors
        self.left = set(receivers)
        self.done = threading.Event()
        self.lock = threading.Lock()
        if not self.left:
            self.done.set()

    def delivered(self, replica: int) -> None:
        """``replica`` has it, or will never need it (a replica replaced: once only)."""
        with self.lock:
            self.left.discard(replica)
            if not self.left and not self.done.is_set():
                self.tensors = None  # the snapshot's memory goes as soon as every replica has it
                self.done.set()


class SendQueue:
    """Snapshots sent to ``len(senders)`` replicas, replica ``r`` by ``senders[r]`` on a
    thread of its own, in the order :meth:`put` received them."""

    def __init__(self, senders: Sequence[Send], max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.in_flight: deque[_Delivery] = deque()
        self.errors: list[tuple[int, BaseException]] = []
        self.lock = threading.Lock()  # errors and queues: a replaced sender's thread may still run
        self.queues: list[queue.Queue[_Delivery | None]] = [queue.Queue() for _ in senders]
        self.threads = [self._thread(r, send, self.queues[r]) for r, send in enumerate(senders)]

    def _thread(self, replica: int, send: Send, deliveries: queue.Queue[_Delivery | None]) -> threading.Thread:
        thread = threading.Thread(
            target=self._run,
            args=(replica, send, deliveries),
            name=f"geartrain-weights-to-replica-{replica}",
            daemon=True,
        )
        thread.start()
        return thread

    def _run(self, replica: int, send: Send, deliveries: queue.Queue[_Delivery | None]) -> None:
        failed = False
        while (delivery := deliveries.get()) is not None:
            if not failed:  # after a failure the group is broken: later snapshots are not sent
                try:
                    tensors = delivery.tensors
                    if tensors is not None:  # None: dropped for a replaced replica
                        send(tensors)
                except BaseException as exc:  # noqa: BLE001 - raised on the trainer's next call
                    with self.lock:
                        if self.queues[replica] is deliveries:  # not replaced since
                            self.errors.append((replica, exc))
                    failed = True
            delivery.delivered(replica)

    def replace(self, replica: int, send: Send) -> None:
        """Send to ``replica`` by ``send`` from now on (a replica started in place of a
        dead one, over a new group): the snapshots not delivered to the old one are
        dropped for it, its failure is forgotten, and its thread is left to end (it may
        be stuck in a send to the dead replica until the group's timeout)."""
        with self.lock:
            old = self.queues[replica]
            self.queues[replica] = queue.Queue()
            self.errors = [(r, e) for r, e in self.errors if r != replica]
        old.put(None)
        for delivery in list(self.in_flight):
            delivery.delivered(replica)
        self.threads[replica] = self._thread(replica, send, self.queues[replica])

    def _raise(self) -> None:
        if self.errors:
            replica, error = self.errors[0]
            raise RuntimeError(f"sending the weights to rollout replica {replica} failed: {error}") from error

    def _retire(self, keep: int) -> None:
        """Wait until at most ``keep`` snapshots are still on their way."""
        while len(self.in_flight) > keep:
            self.in_flight[0].done.wait()
            self.in_flight.popleft()
        while self.in_flight and self.in_flight[0].done.is_set():
            self.in_flight.popleft()

    def put(self, tensors: list[tuple[str, torch.Tensor]], to: Sequence[int] | None = None) -> int:
        """Queue ``tensors`` for every replica (or the replicas ``to``), after waiting (if
        needed) until fewer than ``max_in_flight`` earlier snapshots are undelivered.
        Raises (a ``RuntimeError`` naming the replica) if an earlier send failed. Returns
        the snapshots in flight."""
        self._retire(self.max_in_flight - 1)
        self._raise()
        receivers = list(range(len(self.queues)) if to is None else to)
        delivery = _Delivery(tensors, receivers)
        self.in_flight.append(delivery)
        for r in receivers:
            self.queues[r].put(delivery)
        return len(self.in_flight)

    def wait(self) -> None:
        """Wait until every snapshot was delivered; raise what a send raised."""
        self._retire(0)
        self._raise()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the threads after what is queued (waiting at most ``timeout_s`` each)."""
        for q in self.queues:
            q.put(None)
        for thread in self.threads:
            thread.join(timeout=timeout_s)
