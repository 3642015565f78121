"""Node watchdog: a multi-node run ends, naming the node, when a Ray node holding its workers dies.

verl's driver waits on its worker groups with plain ``ray.get`` and its data plane (TransferQueue,
ZMQ) has no timeouts: when a machine is lost mid-step, Ray fails the calls to the dead workers, but a
call that waits on a peer instead (a collective, a ZMQ request to a storage unit) can wait forever.
The trainer therefore owns a daemon thread that polls ``ray.nodes()`` every ``WATCH_PERIOD_S``; once a
node holding a bundle of the run's placement groups (actor, critic, reference, teacher, rollout
replicas) is no longer alive it prints which node and how to continue, and ends the trainer's
process (``os._exit``): verl's driver then sees its TaskRunner die and the job ends FAILED. Nodes
without the run's workers (e.g. ones an autoscaler removes) are not watched. Resume with
``trainer.resume_mode=auto`` from the last checkpoint once the node is back.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Iterable

__all__ = ["WATCH_PERIOD_S", "LOST_NODE_STATUS", "pool_nodes", "lost_nodes", "loss_message", "NodeWatchdog"]

#: seconds between two looks at the cluster's nodes
WATCH_PERIOD_S = 5.0
#: exit status of the trainer process when a watched node is lost
LOST_NODE_STATUS = 75


def pool_nodes(placement_groups: Iterable) -> set[str]:
    """Hex ids of the nodes holding a bundle of any of ``placement_groups`` (Ray placement groups)."""
    from ray.util import placement_group_table

    return {node for pg in placement_groups for node in placement_group_table(pg)["bundles_to_node_id"].values()}


def lost_nodes(watched: set[str], nodes: list[dict]) -> list[dict]:
    """The watched nodes that ``nodes`` (``ray.nodes()``: dicts with NodeID, Alive, ...) no longer lists alive."""
    info = {n["NodeID"]: n for n in nodes}
    return [info.get(node, {"NodeID": node}) for node in sorted(watched) if not info.get(node, {}).get("Alive", False)]


def loss_message(lost: list[dict]) -> str:
    names = ", ".join(f"{n['NodeID']} ({n.get('NodeManagerAddress', '?')})" for n in lost)
    return (
        f"[verl-memopd] node watchdog: Ray node(s) {names} holding this run's workers died; ending the run. "
        f"Resubmit with trainer.resume_mode=auto to continue from the last checkpoint."
    )


def _end_process(message: str) -> None:
    print(message, flush=True)
    print(message, file=sys.stderr, flush=True)
    os._exit(LOST_NODE_STATUS)


class NodeWatchdog(threading.Thread):
    """Daemon thread: ``on_loss(message)`` once a watched node is lost (default: print and end the process)."""

    def __init__(
        self,
        watched: set[str],
        list_nodes: Callable[[], list[dict]] | None = None,
        period_s: float = WATCH_PERIOD_S,
        on_loss: Callable[[str], None] = _end_process,
    ):
        super().__init__(name="memopd-node-watchdog", daemon=True)
        if not watched:
            raise ValueError("NodeWatchdog needs at least one node to watch")
        if list_nodes is None:
            import ray

            list_nodes = ray.nodes
        self.watched, self.list_nodes, self.period_s, self.on_loss = set(watched), list_nodes, period_s, on_loss
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            lost = lost_nodes(self.watched, self.list_nodes())
            if lost:
                self.on_loss(loss_message(lost))
                return

    def stop(self) -> None:
        self.stopped.set()
