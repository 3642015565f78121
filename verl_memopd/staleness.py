"""Off-policy staleness of an episode's calls, read from their invocation records (no verl).

Under verl's asynchronous V1 trainers (``memopd.trainer.base=colocate_async | separate_async``) an episode
can be sampled by weights older than the ones being trained, and a partial rollout can pause a call across
a weight update and resume it under the new weights. Each ``records.Invocation`` carries the policy version
that sampled it (``policy_version = (first, last)``, verl's weight version: the trainer step whose update the
rollout server last received, 0 = the initial weights).

Convention (verl's own, ``training/off_policy/trajectory_staleness*`` in ``PPOTrainer._compute_metrics``):
at training step ``s`` (verl's ``global_steps``, from 1) the trainer holds the weights of version ``s - 1``;
a token sampled by version ``v`` is ``(s - 1) - v`` updates stale, 0 = on-policy (every step of the
synchronous trainer). verl reports this per trajectory (the oldest and the newest version of the whole row);
these metrics are per call, from the records:

    memopd/staleness/mean, /max, /min     per call: (s - 1) - first   (its oldest token's lag: the worst case)
    memopd/staleness/newest_mean          per call: (s - 1) - last    (its newest token's lag)
    memopd/staleness/calls_spanning_update     share of calls sampled by more than one version (first < last)
    memopd/staleness/episodes_spanning_update  share of episodes whose calls saw more than one version
    memopd/staleness/calls_versioned      share of calls whose record carries a version (1.0 in a healthy run)

Records written before ``policy_version`` existed carry the versions in ``Episode.extra["weight_steps"]``
(one ``[first, last]`` per call, what the memory agent loop recorded); :func:`call_versions` reads those when
the field is absent.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from verl_memopd.records import Episode, RecordError, as_policy_version

__all__ = ["call_versions", "staleness_metrics", "PREFIX"]

PREFIX = "memopd/staleness/"

Version = Optional[tuple[int, int]]


def call_versions(episode: Union[Episode, Mapping[str, Any]]) -> list[Version]:
    """Per call of ``episode`` (an ``Episode`` or its ``to_dict()``), its ``(first, last)`` policy version or None.

    Reads ``Invocation.policy_version``; a call without one falls back to ``extra["weight_steps"][t]``
    (a ``[first, last]`` pair, None entries for unknown). Malformed versions raise ``RecordError``."""
    if isinstance(episode, Episode):
        invocations = [inv.policy_version for inv in episode.invocations]
        extra, eid = episode.extra, episode.episode_id
    else:
        invocations = [(raw or {}).get("policy_version") for raw in episode.get("invocations") or ()]
        extra, eid = episode.get("extra") or {}, episode.get("episode_id", "?")
    fallback = extra.get("weight_steps") or ()
    out: list[Version] = []
    for t, version in enumerate(invocations):
        if version is None and t < len(fallback) and fallback[t] is not None and None not in fallback[t]:
            version = fallback[t]
        out.append(None if version is None else as_policy_version(version, f"episode {eid!r} call {t}"))
    return out


def staleness_metrics(episodes: Iterable[Union[Episode, Mapping[str, Any]]], global_steps: int) -> dict[str, float]:
    """The ``memopd/staleness/*`` metrics of the episodes trained at step ``global_steps`` (see the module doc).

    Empty when no call carries a version (nothing to report; ``calls_versioned`` is then 0 if there were
    calls). A version newer than the trainer's weights (``first > global_steps - 1``) is impossible and
    raises ``RecordError``: a record from another run or a wrong step counter."""
    current = int(global_steps) - 1
    per_episode: list[Sequence[Version]] = [call_versions(ep) for ep in episodes]
    calls = [v for versions in per_episode for v in versions]
    known = [v for v in calls if v is not None]
    if not calls:
        return {}
    if not known:
        return {PREFIX + "calls_versioned": 0.0}
    future = [v for v in known if v[1] > current]
    if future:
        raise RecordError(
            f"a call sampled by policy version {future[0]} at training step {global_steps}, whose weights are "
            f"version {current}: the record is from another run or the step counter is wrong"
        )
    oldest = [current - first for first, _ in known]
    newest = [current - last for _, last in known]
    spans = [
        len({x for v in versions if v is not None for x in v}) > 1
        for versions in per_episode
        if any(v is not None for v in versions)
    ]
    return {
        PREFIX + "mean": sum(oldest) / len(oldest),
        PREFIX + "max": float(max(oldest)),
        PREFIX + "min": float(min(oldest)),
        PREFIX + "newest_mean": sum(newest) / len(newest),
        PREFIX + "calls_spanning_update": sum(first < last for first, last in known) / len(known),
        PREFIX + "episodes_spanning_update": sum(spans) / len(spans),
        PREFIX + "calls_versioned": len(known) / len(calls),
    }
