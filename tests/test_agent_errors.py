"""The agent loop's own error becomes the training job's top-level error.

verl's replay buffer reports a step whose rollouts all failed as "... no materializable trajectories";
the agent loop records its first error (``agent.errors.record``) and the MemOPD trainer's replay buffer
(``agent.errors.surface_in``) raises verl's error again with that cause first.
"""

import pytest
from test_agent import FakeServer, _config, _row, _run, _script, tokenizer  # noqa: F401 (tokenizer: fixture)

from verl_memopd.agent import errors as agent_errors

VERL_ERROR = "Sync replay buffer selected terminal groups with no materializable trajectories."


class FailingBuffer:
    def __init__(self, error=None):
        self.error, self.calls = error, 0

    def sample(self, global_steps, partition_id, batch_size):
        self.calls += 1
        if self.error:
            raise self.error
        return ("batch", partition_id), {}


def test_verls_error_is_raised_again_with_the_recorded_cause():
    store = {}
    agent_errors.record(
        "ValueError: row 3 (val-3): packed episode needs actor_rollout_ref.rollout.response_length >= 16418 (is 8192)",
        store,
    )
    agent_errors.record("RuntimeError: a later error", store)  # only the first is kept
    buffer = agent_errors.surface_in(FailingBuffer(RuntimeError(VERL_ERROR)), store)
    with pytest.raises(RuntimeError) as e:
        buffer.sample(1, "train", 4)
    assert str(e.value) == (
        "the memory agent loop failed: ValueError: row 3 (val-3): packed episode needs "
        "actor_rollout_ref.rollout.response_length >= 16418 (is 8192) (first error of this job; "
        f"verl: {VERL_ERROR})"
    )
    assert isinstance(e.value.__cause__, RuntimeError)


def test_other_errors_and_results_pass_through():
    assert agent_errors.surface_in(FailingBuffer(), {}).sample(1, "val", 2) == (("batch", "val"), {})
    with pytest.raises(RuntimeError, match=f"^{VERL_ERROR}$"):  # nothing recorded: verl's error unchanged
        agent_errors.surface_in(FailingBuffer(RuntimeError(VERL_ERROR)), {}).sample(1, "train", 4)
    store = {}
    agent_errors.record("ValueError: x", store)
    with pytest.raises(RuntimeError, match="^out of memory$"):
        agent_errors.surface_in(FailingBuffer(RuntimeError("out of memory")), store).sample(1, "train", 4)
    assert agent_errors.first() is None and agent_errors.record("outside Ray: nothing is stored") is None


def test_the_agent_loop_records_its_error_and_still_raises_it(tokenizer, monkeypatch):  # noqa: F811
    recorded = []
    monkeypatch.setattr(agent_errors, "record", recorded.append)
    config = _config()
    config.actor_rollout_ref.rollout.response_length = 100
    with pytest.raises(ValueError, match="response_length >= "):
        _run(tokenizer, FakeServer(_script(tokenizer, ["a", "b"])), _row(), config)
    assert len(recorded) == 1 and recorded[0].startswith(
        "ValueError: row 3 (val-3): packed episode needs actor_rollout_ref.rollout.response_length >= "
    )
