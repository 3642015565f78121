"""Per-record policy versions and the ``memopd/staleness/*`` metrics (``verl_memopd.staleness``), on synthetic
records: no Ray, no verl."""

from __future__ import annotations

import json

import pytest

from verl_memopd.records import Episode, Invocation, RecordError
from verl_memopd.staleness import call_versions, staleness_metrics

Q = (1, 2, 3)


def _call(version, n=2):
    return Invocation(Q + (4,), (5,) * n, (-0.5,) * n, policy_version=version)


def _episode(eid, versions, **extra):
    return Episode(eid, "u", Q, tuple(_call(v) for v in versions), extra=extra)


def test_policy_version_round_trips_and_old_records_still_load():
    ep = _episode("e", [(2, 2), (2, 3)])
    back = Episode.from_dict(json.loads(json.dumps(ep.to_dict())))  # JSON turns the pairs into lists
    assert [inv.policy_version for inv in back.invocations] == [(2, 2), (2, 3)]
    old = ep.to_dict()
    for raw in old["invocations"]:
        del raw["policy_version"]  # a record written before the field existed
    assert [inv.policy_version for inv in Episode.from_dict(old).invocations] == [None, None]


@pytest.mark.parametrize(
    "bad, message",
    [
        ((3, 2), r"0 <= first <= last"),
        ((-1, 0), r"0 <= first <= last"),
        ((1,), r"not a \(first, last\) pair"),
        ("12", r"not a \(first, last\) pair"),
        ((1.5, 2), r"first = 1.5 is not an integer"),
        ((True, 2), r"first = True is not an integer"),
    ],
)
def test_bad_policy_versions_are_refused_naming_the_call_and_field(bad, message):
    with pytest.raises(RecordError, match=message):
        _call(bad)
    d = _episode("e7", [(0, 0), (0, 0)]).to_dict()
    d["invocations"][1]["policy_version"] = list(bad) if isinstance(bad, tuple) else bad
    with pytest.raises(RecordError, match=r"episode 'e7' call 1: policy_version"):
        Episode.from_dict(d)


def test_staleness_per_call_against_the_trainers_weights():
    # step 5 trains with the weights of version 4 (verl: one weight update per step, version 0 = initial)
    episodes = [
        _episode("a", [(4, 4), (4, 4)]),  # on-policy
        _episode("b", [(2, 2), (2, 3), (3, 3)]),  # sampled across an update, one call paused and resumed over it
        _episode("c", [(3, 3), (3, 3)]),  # one step stale, never across an update
    ]
    m = staleness_metrics(episodes, global_steps=5)
    oldest = [0, 0, 2, 2, 1, 1, 1]  # (5 - 1) - first, per call
    newest = [0, 0, 2, 1, 1, 1, 1]  # (5 - 1) - last
    assert m["memopd/staleness/mean"] == pytest.approx(sum(oldest) / 7)
    assert m["memopd/staleness/max"] == 2 and m["memopd/staleness/min"] == 0
    assert m["memopd/staleness/newest_mean"] == pytest.approx(sum(newest) / 7)
    assert m["memopd/staleness/calls_spanning_update"] == pytest.approx(1 / 7)
    assert m["memopd/staleness/episodes_spanning_update"] == pytest.approx(1 / 3)
    assert m["memopd/staleness/calls_versioned"] == 1.0
    # the synchronous trainer: every call sampled by the weights being trained
    sync = staleness_metrics([_episode("s", [(0, 0), (0, 0)])], global_steps=1)
    assert sync["memopd/staleness/max"] == 0 and sync["memopd/staleness/episodes_spanning_update"] == 0


def test_versions_fall_back_to_the_loops_weight_steps_and_unknown_calls_are_counted():
    ep = _episode("f", [None, None, None], weight_steps=[[1, 1], [1, 2], [None, None]])
    assert call_versions(ep) == [(1, 1), (1, 2), None]
    assert call_versions(ep.to_dict()) == [(1, 1), (1, 2), None]
    m = staleness_metrics([ep.to_dict()], global_steps=3)
    assert m["memopd/staleness/calls_versioned"] == pytest.approx(2 / 3)
    assert m["memopd/staleness/max"] == 1 and m["memopd/staleness/episodes_spanning_update"] == 1.0
    assert staleness_metrics([_episode("g", [None])], global_steps=3) == {"memopd/staleness/calls_versioned": 0.0}
    assert staleness_metrics([], global_steps=3) == {}


def test_a_version_newer_than_the_trainers_weights_is_refused():
    with pytest.raises(RecordError, match=r"policy version \(3, 3\) at training step 3, whose weights are version 2"):
        staleness_metrics([_episode("h", [(3, 3)])], global_steps=3)
