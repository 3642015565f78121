"""The trainer's node watchdog (verl_memopd.trainer.watchdog): which nodes it watches and when it fires.

The fault itself (a node's Ray killed mid-step, the job ending FAILED, the resume) is
tests/test_multinode_ray.py; here the logic, with ``ray.nodes()`` and placement groups faked.
"""

from __future__ import annotations

import threading

import pytest

from verl_memopd.trainer import watchdog
from verl_memopd.trainer.watchdog import NodeWatchdog, loss_message, lost_nodes, pool_nodes


def _node(node_id: str, alive: bool) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"10.0.0.{node_id[-1]}"}


def test_only_watched_nodes_that_are_dead_or_gone_are_lost():
    nodes = [_node("a1", True), _node("b2", False), _node("c3", False)]
    assert lost_nodes({"a1"}, nodes) == []
    assert [n["NodeID"] for n in lost_nodes({"a1", "b2"}, nodes)] == ["b2"]  # c3 is not ours: ignored
    assert lost_nodes({"a1", "d4"}, nodes) == [{"NodeID": "d4"}]  # no longer listed at all
    message = loss_message(lost_nodes({"b2"}, nodes))
    assert "b2 (10.0.0.2)" in message and "trainer.resume_mode=auto" in message


def test_watched_nodes_are_those_of_the_runs_placement_groups(monkeypatch):
    import ray.util

    tables = {"pg_actor": {"bundles_to_node_id": {0: "a1", 1: "b2"}}, "pg_teacher": {"bundles_to_node_id": {0: "b2"}}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: tables[pg])
    assert pool_nodes(["pg_actor", "pg_teacher"]) == {"a1", "b2"}


def test_fires_once_when_a_watched_node_dies_and_not_before():
    alive = {"b2": True}
    fired: list[str] = []
    done = threading.Event()
    polls = []

    def list_nodes():
        polls.append(1)
        if len(polls) == 3:
            alive["b2"] = False
        return [_node("a1", True), _node("b2", alive["b2"])]

    dog = NodeWatchdog({"a1", "b2"}, list_nodes, period_s=0.01, on_loss=lambda m: (fired.append(m), done.set()))
    dog.start()
    assert done.wait(5) and dog.daemon
    dog.join(5)
    assert not dog.is_alive() and len(fired) == 1 and len(polls) == 3 and "b2" in fired[0]


def test_stop_ends_the_thread_quietly_and_an_empty_watch_is_refused():
    dog = NodeWatchdog({"a1"}, lambda: [_node("a1", True)], period_s=0.01, on_loss=pytest.fail)
    dog.start()
    dog.stop()
    dog.join(5)
    assert not dog.is_alive()
    with pytest.raises(ValueError, match="at least one node"):
        NodeWatchdog(set(), lambda: [])
    assert watchdog.LOST_NODE_STATUS != 0
