"""``memopd_replay_agent``: replaying a recorded episode gives the live memory agent's packed row exactly (log-probs
aside), sends nothing to the server, and refuses a trajectory the agent could not have produced."""

import copy

import pytest
from hydra.errors import InstantiationException
from test_agent import FakeServer, _config, _row, _run, _script, tokenizer  # noqa: F401  (tokenizer: a fixture)

from verl_memopd.agent.replay import REPLAY_AGENT_NAME, ReplayError
from verl_memopd.fields import EPISODE, POSITION_IDS, REPLAY, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.records import Episode, RecordError
from verl_memopd.staleness import PREFIX, staleness_metrics


class NoServer:
    """A server that must not be asked."""

    async def generate(self, *args, **kwargs):
        raise AssertionError("the replay agent sent a request to the rollout server")


def _replay(tok, row, config=None, **run_kwargs):
    return _run(tok, NoServer(), row, config, agent=REPLAY_AGENT_NAME, **run_kwargs)


@pytest.fixture(scope="module")
def live(tokenizer):  # noqa: F811
    row = _row()
    server = FakeServer(_script(tokenizer, [a[0] for a in row["reward_model"]["ground_truth"]]))
    output = _run(tokenizer, server, row)
    return row, output, Episode.from_dict(output.extra_fields[EPISODE])


def _replay_row(row, episode):
    out = copy.deepcopy(row)
    out["extra_info"] = {
        **out["extra_info"],
        REPLAY: [{"prompt_ids": list(c.prompt_ids), "response_ids": list(c.response_ids)} for c in episode.invocations],
    }
    return out


def test_replay_reproduces_the_live_row_without_the_server(tokenizer, live):  # noqa: F811
    row, output, episode = live
    replayed = _replay(tokenizer, _replay_row(row, episode))
    assert replayed.prompt_ids == output.prompt_ids and replayed.response_ids == output.response_ids
    assert replayed.response_mask == output.response_mask and replayed.reward_score == output.reward_score
    for key in (POSITION_IDS, SEGMENT_IDS, TEACHER_MASK):
        assert replayed.extra_fields[key] == output.extra_fields[key], key
    calls = Episode.from_dict(replayed.extra_fields[EPISODE]).invocations
    assert [c.response_ids for c in calls] == [c.response_ids for c in episode.invocations]
    assert [c.finish_reason for c in calls] == [c.finish_reason for c in episode.invocations]
    assert all(lp == 0.0 for c in calls for lp in c.response_logprobs)  # placeholders: nothing was sampled
    assert any(lp != 0.0 for c in episode.invocations for lp in c.response_logprobs)  # (the live ones were not)


def test_replayed_rows_carry_the_staleness_tags_verl_requires_and_read_on_policy(tokenizer, live):  # noqa: F811
    """At trainer step 7 the trainer holds weights version 6: the replayed calls are tagged 6 (staleness 0); the
    asking step itself (7) would be a version from the future, which the staleness metrics refuse."""
    row, _, episode = live
    replayed = _replay(tokenizer, _replay_row(row, episode), global_steps=7, session_id=0)
    assert (replayed.extra_fields["min_global_steps"], replayed.extra_fields["max_global_steps"]) == (6, 6)
    metrics = staleness_metrics([replayed.extra_fields[EPISODE]], global_steps=7)
    assert metrics[PREFIX + "max"] == 0.0 and metrics[PREFIX + "calls_versioned"] == 1.0
    with pytest.raises(RecordError, match="policy version"):
        staleness_metrics([replayed.extra_fields[EPISODE]], global_steps=6)


def test_replay_refuses_a_context_that_differs_from_the_recording(tokenizer, live):  # noqa: F811
    row, _, episode = live
    bad = _replay_row(row, episode)
    bad["extra_info"][REPLAY][1]["prompt_ids"][-3] += 1
    with pytest.raises(ReplayError, match=r"call 1: the context the agent built .* from token"):
        _replay(tokenizer, bad)


def test_replay_refuses_a_reply_the_agent_cannot_have_made(tokenizer, live):  # noqa: F811
    row, _, episode = live
    bad = _replay_row(row, episode)
    bad["extra_info"][REPLAY][0]["response_ids"] = bad["extra_info"][REPLAY][0]["response_ids"][:-1]  # no stop, short
    with pytest.raises(ReplayError, match=r"call 0: recorded response_ids of 5 tokens for a budget of 12"):
        _replay(tokenizer, bad)


def test_replay_refuses_missing_or_extra_calls_and_bypass_mode(tokenizer, live):  # noqa: F811
    row, _, episode = live
    extra = _replay_row(row, episode)
    extra["extra_info"][REPLAY].append(extra["extra_info"][REPLAY][-1])
    with pytest.raises(ReplayError, match=r"has 5 calls, the episode made 4"):
        _replay(tokenizer, extra)
    with pytest.raises(ReplayError, match=rf"extra_info.{REPLAY} is missing"):
        _replay(tokenizer, row)
    config = _config()
    config.algorithm = {"rollout_correction": {"bypass_mode": True}}
    with pytest.raises(InstantiationException, match="bypass_mode=true would take the replayed"):  # hydra wraps it
        _replay(tokenizer, _replay_row(row, episode), config)
