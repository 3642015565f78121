"""Every key MemOPD adds to verl's data: one home, so a producer and its consumers cannot drift apart.

Grouped by where the key lives, in the order the data flows. Each is a plain string; this module imports
nothing, so every stage (and an agent loop written outside this package) can use it.
"""

__all__ = [
    "REPLAY",
    "EPISODE",
    "POSITION_IDS",
    "SEGMENT_IDS",
    "TEACHER_MASK",
    "CALL_INDEX",
    "CALLS_ALONE",
    "PROMPT_GROUP",
    "TEACHER_NUM_TOKENS",
    "TEACHER_NUM_TOKENS_PER_CALL",
    "SEGMENTS",
    "PACKED_INDEX",
    "PADDED_MASK",
    "STUDENT_HIDDEN",
    "STUDENT_HEAD",
    "STUDENT_LOGITS",
    "STUDENT_LOGITS_STREAM",
    "TEACHER_HEAD",
    "TEACHER_HIDDEN",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOGPROBS",
    "TEACHER_TAIL_LOGPROB",
    "TEACHER_OUTPUT_KEY",
    "TEACHER_TRANSPORT",
    "FLAT_SEPARATOR",
    "TEACHER_HIDDEN_FLAT",
    "TEACHER_HIDDEN_ALIGNED",
    "RCE_FLAG",
    "RCE_FIELD",
    "RCE_TOLERANCE_FIELD",
    "RECORD_FIELDS",
]

# -- a dataset row's ``extra_info`` (read by an agent loop) -------------------------------------------------------
#: the recorded calls ``memopd_replay_agent`` replays instead of sampling (``agent/replay.py``): a list, one
#: ``{"prompt_ids": [...], "response_ids": [...]}`` per call in order
REPLAY = "memopd_replay"

# -- the agent loop's ``AgentLoopOutput.extra_fields`` (the contract of an agent loop; docs/agent_contract.md) --
#: the episode's invocation records, ``records.Episode.to_dict()``
EPISODE = "memopd_episode"
#: (L,) the packed row's restored positions: each call's tokens at the positions the call saw
POSITION_IDS = "memopd_position_ids"
#: (L,) the packed row's segment of each token: 0 = the shared prefix, c = call c (also a training-row field)
SEGMENT_IDS = "memopd_segment_ids"
#: (R,) over the row's response: 1 where the teacher scores the token (sampled tokens), else 0 (also a row field)
TEACHER_MASK = "memopd_teacher_mask"

# -- per-row fields of the training batch (TransferQueue / TensorDict), written by ``trainer/rows.py`` -----------
#: (R,) the call index (0-based) of each response token
CALL_INDEX = "memopd_call_index"
#: scalar, 1 = execute the row's calls alone (``memopd.layout=per_call``)
CALLS_ALONE = "memopd_calls_alone"
#: scalar, the row's prompt group within the step (-1 = never share its prefix)
PROMPT_GROUP = "memopd_prompt_group"
#: non-tensor int of a mini-batch: its teacher-scored tokens over all data-parallel ranks (the loss's normaliser)
TEACHER_NUM_TOKENS = "memopd_teacher_num_tokens"
#: non-tensor tuple: the same per call index
TEACHER_NUM_TOKENS_PER_CALL = "memopd_teacher_num_tokens_per_call"

# -- model inputs and outputs inside the packed engines -----------------------------------------------------------
#: model kwarg: ``segments.SegmentMeta`` of the micro-batch, read by the ``memopd_*`` attention implementations
SEGMENTS = "memopd_segments"
#: output_args of the per_call execution: where each packed token sits in the padded call batch
PACKED_INDEX = "memopd_packed_index"
#: output_args of the per_call execution: (calls, width) bool, real tokens of the padded call batch
PADDED_MASK = "memopd_padded_mask"
#: model output: the student's final hidden states (the loss forms logits in vocabulary chunks)
STUDENT_HIDDEN = "memopd_hidden"
#: model output: the student's lm_head weight (V, H)
STUDENT_HEAD = "memopd_lm_head_weight"
#: model output: the student's full logits, when the engine forms them
STUDENT_LOGITS = "memopd_logits"
#: model output: the student's logits over the packed stream (before the per-call gather)
STUDENT_LOGITS_STREAM = "memopd_logits_stream"
#: model output: the actor's frozen copy of the teacher's lm_head (the ``hidden`` transport)
TEACHER_HEAD = "memopd_teacher_head_weight"

# -- teacher supervision payloads (``supervision.py`` transports) --------------------------------------------------
#: ``hidden`` transport: the teacher's final post-norm hidden states, (B, A*, H)
TEACHER_HIDDEN = "memopd_teacher_hidden"
#: ``topk`` transport: (B, A*, k) token ids, their log-probs, and the log of the remaining mass (B, A*)
TEACHER_TOPK_IDS = "memopd_teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "memopd_teacher_topk_logprobs"
TEACHER_TAIL_LOGPROB = "memopd_teacher_tail_logprob"
#: non-tensor option of a teacher batch: the field its hidden states go to
TEACHER_OUTPUT_KEY = "memopd_teacher_output_key"
#: non-tensor option of a teacher batch: ``{"name": transport, "vocab_size": V, **transport options}``
TEACHER_TRANSPORT = "memopd_transport"
#: non-tensor option of a teacher batch in the flat layout: the turn separator ids (resolved
#: ``memopd.teacher.flat_separator_ids``), inserted before every call block t >= 1 (``streams.flat_history``)
FLAT_SEPARATOR = "memopd_flat_separator"
#: the teacher's hidden states on the flat rows (``memopd.teacher.state=flat``)
TEACHER_HIDDEN_FLAT = "memopd_teacher_hidden_flat"
#: the audit pass of ``memopd.teacher.state=flat``: the teacher on the aligned rows
TEACHER_HIDDEN_ALIGNED = "memopd_teacher_hidden_aligned"

# -- audits (``trainer/audit.py``) --------------------------------------------------------------------------------
#: non-tensor flag on the old-log-prob batch: run the RCE check in the actor engine
RCE_FLAG = "memopd_audit_rce"
#: per-row output of the RCE check: each call's figures, (n_calls, 5) float32 (``audit.STAT_COLUMNS``)
RCE_FIELD = "memopd_rce_max_abs_diff"
#: per-row output of the RCE check: each call's bound on column 0 of ``RCE_FIELD``, (n_calls,)
RCE_TOLERANCE_FIELD = "memopd_rce_tolerance"
#: per-row inputs of the RCE check on audit steps: the row's recorded calls
#: (``audit.encode_records``: ids (T,), action (T,), lengths (C,) int64)
RECORD_FIELDS = {
    "ids": "memopd_rce_record_ids",
    "action": "memopd_rce_record_action",
    "lengths": "memopd_rce_record_lengths",
}
