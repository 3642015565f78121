"""FSDP engines that execute MemOPD rows: restored positions and call-block visibility.

verl's FSDP engines run each micro-batch through the HF model with plain causal attention.
These subclasses (registered in verl's ``EngineRegistry``, selected by model type) build the
packed-attention metadata from the row's ``memopd_segment_ids`` (restored by
``verl_memopd.trainer.rows``) and pass it to the ``memopd_*`` attention implementation
(``verl_memopd.attention``); everything else -- log-probs, entropy, values, FSDP -- is verl's.

    memopd_language_model  actor / ref: + full-vocabulary logits for the OPD loss when asked,
                           + the RCE spot-check on audit steps (verl_memopd.trainer.audit)
    memopd_value_model     critic
    memopd_teacher         teacher worker group: its supervision at m_T positions, encoded by the
                           transport (hidden states, or top-k + tail computed with its own head)

The teacher's flat pass (``memopd.teacher.state=flat``, batches carrying ``memopd_flat_separator``) runs
the persistent history with its turns separated (``verl_memopd.streams.flat_history``), read back the same
way. With ``memopd.layout=per_call`` (rows flagged ``memopd_calls_alone``) the same engines run every
call as its own sequence (``verl_memopd.streams.calls_alone``) and read the outputs back in the packed
order (the remove-padding stream or verl's padded batch): the per-call baseline. With
``memopd.share_prefix_across_group`` (rows carrying a ``memopd_prompt_group``) the rows of one
prompt group in a micro-batch compute their common ``q`` once (``verl_memopd.streams.share_prefix``) and
are read back the same way.

Both of verl's micro-batch paths are supported: remove-padding (one ``(1, N)`` token stream)
and padded ``(B, L)`` (right-padded rows; padding runs are isolated segments). Ulysses
sequence parallelism is refused (its slicing does not know the segments).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from verl_memopd.attention import PackedAttentionError, attention_implementation, require_packed_attention
from verl_memopd.fields import (
    CALL_INDEX,
    CALLS_ALONE,
    FLAT_SEPARATOR,
    PACKED_INDEX,
    PADDED_MASK,
    PROMPT_GROUP,
    RCE_FLAG,
    SEGMENT_IDS,
    SEGMENTS,
    STUDENT_LOGITS,
    STUDENT_LOGITS_STREAM,
    TEACHER_MASK,
    TEACHER_OUTPUT_KEY,
    TEACHER_TRANSPORT,
)
from verl_memopd.losses.actor import assign_global_teacher_counts
from verl_memopd.platform.patches import patch_verl_valuehead_attention
from verl_memopd.segments import SegmentMeta, padded_batch_segments, segment_meta
from verl_memopd.streams import calls_alone, flat_history, share_prefix
from verl_memopd.supervision import encode_teacher_rows, get_transport, load_output_head
from verl_memopd.trainer.audit import engine_rce_fields

_DEVICES = ["cuda", "npu", "cpu"]
EXPORT_ATTENTION = "sdpa"  # what a saved actor's Hugging Face config names (any device, transformers' default)
_BACKENDS = ["fsdp", "fsdp2"]


@contextmanager
def _exported_attention(hf_model: torch.nn.Module) -> Iterator[None]:
    """While saving: ``hf_model`` runs :data:`EXPORT_ATTENTION` and its config loses the ``attn_implementation``
    attribute verl's ``override_config`` set on it (transformers writes that attribute to config.json)."""
    config = hf_model.config
    override = config.__dict__.pop("attn_implementation", None)
    try:
        with attention_implementation(hf_model, EXPORT_ATTENTION):
            yield
    finally:
        if override is not None:
            config.attn_implementation = override


def _rows(micro_batch) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Per-row tokens, restored positions and segment ids of a NO_PADDING micro-batch."""
    return tuple(micro_batch[k].unbind() for k in ("input_ids", "position_ids", SEGMENT_IDS))


def _executes_calls_alone(micro_batch) -> bool:
    if CALLS_ALONE not in micro_batch.keys():
        return False
    flag = micro_batch[CALLS_ALONE]
    return bool((flag.values() if flag.is_nested else flag).any())


def _shared_prefix_stream(micro_batch):
    """``(inputs, index)`` of the micro-batch with each prompt group's q computed once, or None."""
    if PROMPT_GROUP not in micro_batch.keys():
        return None
    groups = micro_batch[PROMPT_GROUP].reshape(-1).tolist()
    return share_prefix(*_rows(micro_batch), groups)


def _separated_history_stream(micro_batch):
    """``(inputs, index)`` of a flat-layout micro-batch with the turn separator inserted (the batch's
    ``memopd_flat_separator``, set for the teacher's flat pass), or None when it carries none."""
    separator = tuple(tu.get_non_tensor_data(data=micro_batch, key=FLAT_SEPARATOR, default=()) or ())
    if not separator:
        return None
    if CALL_INDEX not in micro_batch.keys():
        raise PackedAttentionError(f"micro-batch has {FLAT_SEPARATOR} but no {CALL_INDEX} to find the call blocks")
    return flat_history(micro_batch["input_ids"].unbind(), micro_batch[CALL_INDEX].unbind(), separator)


def micro_batch_segments(micro_batch, use_remove_padding: bool) -> SegmentMeta:
    """Attention metadata of a verl NO_PADDING micro-batch (jagged rows) for either forward path."""
    if SEGMENT_IDS not in micro_batch.keys():
        raise PackedAttentionError(
            f"micro-batch has no {SEGMENT_IDS}: memopd engines run under the memopd trainer "
            f"(trainer.v1.trainer_mode=memopd), which restores every row's layout"
        )
    seg, pos = micro_batch[SEGMENT_IDS], micro_batch["position_ids"]
    lengths = seg.offsets().diff()
    if use_remove_padding:
        rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return segment_meta(seg.values(), rows, pos.values())
    width = int(lengths.max())
    shape = (lengths.numel(), width)
    mask = torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    return padded_batch_segments(
        torch.nested.to_padded_tensor(seg, 0, shape), mask.long(), torch.nested.to_padded_tensor(pos, 0, shape)
    )


class _PackedRows:
    """Mixin: packed attention for every forward of a verl FSDP engine.

    The registry key (``memopd_*``) selects the engine; verl's FSDP engine then reads
    ``model_config.model_type`` to choose the HF model class, so it gets verl's own type back.
    """

    base_model_type = "language_model"

    def __init__(self, *args, model_config, **kwargs):
        model_config.model_type = self.base_model_type
        super().__init__(*args, model_config=model_config, **kwargs)

    def initialize(self):
        super().initialize()
        if self.use_ulysses_sp:
            raise PackedAttentionError(
                "memopd engines do not support Ulysses sequence parallelism yet "
                "(ulysses_sequence_parallel_size must be 1)"
            )
        require_packed_attention(self.module)  # never let call blocks see each other

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        device = model_inputs["input_ids"].device
        stream, what = None, ""
        if _executes_calls_alone(micro_batch):
            (inputs, _, index), what = calls_alone(*_rows(micro_batch)), "memopd.layout=per_call"
            stream = inputs, index
        elif (stream := _separated_history_stream(micro_batch)) is not None:
            what = "memopd.teacher.flat_separator_ids"
        else:
            stream, what = _shared_prefix_stream(micro_batch), "memopd.share_prefix_across_group=true"
        if stream is None:
            model_inputs[SEGMENTS] = micro_batch_segments(micro_batch, use_rmpad).to(device)
        else:
            if output_args.get("pad_size", 0):
                raise PackedAttentionError(f"{what} does not support static sequence padding (verl's pad_to_length)")
            inputs, index = stream
            if not use_rmpad:  # verl reads (B, L, *) outputs: where each packed token goes in the padded batch
                lengths = micro_batch["input_ids"].offsets().diff().to(device)
                width = model_inputs["input_ids"].shape[1]
                output_args[PADDED_MASK] = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
            model_inputs.update({k: v.to(device) for k, v in inputs.items()})
            output_args[PACKED_INDEX] = index.to(device)
        model_inputs["attention_mask"] = None  # visibility is the segments' (padding runs are isolated)
        return model_inputs, output_args

    @staticmethod
    def packed_order(output, output_args, logits: bool = True):
        """The model ran another stream than the packed one (``memopd.layout=per_call``: every call
        alone; group-shared prefix: q once per prompt group); put the logits / values (1, N', *)
        back in the packed stream's token order (unless ``logits=False``)."""
        if logits and PACKED_INDEX in output_args:
            output.logits = _PackedRows.packed_tensor(output.logits, output_args)
        return output

    @staticmethod
    def packed_tensor(t: torch.Tensor, output_args) -> torch.Tensor:
        """(1, N', *) model-stream tensor -> (1, N, *) packed stream or (B, L, *) padded batch (as is
        when the model ran the packed stream itself)."""
        index = output_args.get(PACKED_INDEX)
        if index is None:
            return t
        t, mask = t[:, index], output_args.get(PADDED_MASK)
        if mask is None:
            return t
        out = t.new_zeros(*mask.shape, *t.shape[2:])
        out[mask] = t[0]
        return out

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not forward_only and TEACHER_MASK in data.keys():
            # L_OPD is normalised by the teacher tokens of the whole mini-batch on all DP ranks
            assign_global_teacher_counts(data, self.get_data_parallel_group())
        return super().forward_backward_batch(data, loss_function, forward_only=forward_only)


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The final norm of a causal LM (its output: the final post-norm hidden states, (B, L, H))."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise PackedAttentionError(
            f"teacher: no final norm found on {type(model).__name__} (expected "
            f"model.get_decoder().norm, as in Qwen2/Llama)"
        )
    return norm


def _jagged_like(values_bl: torch.Tensor, micro_batch, use_rmpad: bool) -> torch.Tensor:
    """(1, N, ...) stream or (B, L, ...) padded model output -> jagged (B, L_b*, ...) like ``input_ids``."""
    offsets = micro_batch["input_ids"].offsets()
    if use_rmpad:
        tokens = values_bl.squeeze(0)[: int(offsets[-1])]
    else:
        lengths = offsets.diff()
        keep = torch.arange(values_bl.shape[1], device=values_bl.device).unsqueeze(0) < lengths.unsqueeze(1)
        tokens = values_bl[keep]
    return torch.nested.nested_tensor_from_jagged(tokens, offsets)


@EngineRegistry.register(model_type="memopd_language_model", backend=_BACKENDS, device=_DEVICES)
class MemopdLMEngine(_PackedRows, FSDPEngineWithLMHead):
    """Actor / reference engine. Adds ``memopd_logits`` (B, L*, V) to the model output when the
    loss function asks for it (``wants_student_logits``): the exact full-vocabulary student
    distribution the OPD divergence needs, aligned like verl's ``log_probs``."""

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        output = self.packed_order(output, output_args)
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        if getattr(logits_processor_func, "wants_student_logits", False):
            model_output[STUDENT_LOGITS] = _jagged_like(output.logits, micro_batch, use_rmpad)
            model_output[STUDENT_LOGITS_STREAM] = output.logits  # the per-term gradient norms of audit steps
        if tu.get_non_tensor_data(data=micro_batch, key=RCE_FLAG, default=False):
            model_output.update(self._rce_spot_check(output.logits, micro_batch, use_rmpad))
        return model_output

    def save_checkpoint(self, *args, **kwargs):
        """verl's checkpoint, with the Hugging Face config it writes (``huggingface/config.json``, and the
        ``hf_model`` export) naming ``sdpa``: the packed ``memopd_*`` attention the model trains with needs
        segment metadata only these engines supply, so a saved actor loaded with plain transformers would
        refuse to run. The model itself goes back to its packed attention afterwards."""
        with _exported_attention(getattr(self.module, "_fsdp_wrapped_module", self.module)):
            return super().save_checkpoint(*args, **kwargs)

    def _rce_spot_check(self, logits, micro_batch, use_rmpad: bool) -> dict:
        """Audit (``verl_memopd.trainer.audit.engine_rce_fields``): every call of the micro-batch rebuilt from
        its invocation record and run alone under the model's stock attention, compared at the action tokens
        with the packed ``logits`` ((1, N, V) stream or (B, L, V) padded, read in place). Returns per row
        each call's figures (B, n_calls*, 5) and bound (B, n_calls*)."""
        return engine_rce_fields(self.module, logits, micro_batch, use_rmpad)


@EngineRegistry.register(model_type="memopd_value_model", backend=_BACKENDS, device=_DEVICES)
class MemopdValueEngine(_PackedRows, FSDPEngineWithValueHead):
    """Critic engine: verl's value head on the packed layout."""

    base_model_type = "value_model"

    def initialize(self):
        patch_verl_valuehead_attention()  # verl 0.9.1 forces flash_attention_2 for value models
        # the value head is new (random) weights: draw them from the engine's seed (critic.fsdp.seed, verl
        # default 42), so runs that differ only in an option (the experiment's arms, a resume) share the critic
        torch.manual_seed(self.engine_config.seed)
        super().initialize()

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        output = self.packed_order(output, output_args)
        return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)


@EngineRegistry.register(model_type="memopd_teacher", backend=_BACKENDS, device=_DEVICES)
class MemopdTeacherEngine(_PackedRows, FSDPEngineWithLMHead):
    """Teacher engine (forward only): gathers the final post-norm hidden states at the positions that
    predict each row's teacher-supervised tokens (response token j is predicted at sequence position
    P_b + j - 1), in order, and returns them encoded by the batch's transport (``memopd_transport``:
    ``hidden`` -> ``memopd_teacher_hidden`` (B, A_b*, H); ``topk`` -> top-k ids / log-probs (B, A_b*, K)
    + log tail mass (B, A_b*), from the teacher's own output head). An audit batch names another
    output field (``memopd_teacher_output_key``): the hidden states as they are, under that name."""

    _memopd_head = None  # (V_rows, H) fp32 output head, loaded on first use by transports that need it

    def initialize(self):
        super().initialize()
        self._final_norm_output: list[torch.Tensor] = []
        final_norm(self.module).register_forward_hook(lambda _m, _i, out: self._final_norm_output.append(out))

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        # the final norm's output is caught by a hook (output_hidden_states=True would keep every layer's)
        model_inputs["logits_to_keep"] = 1  # the teacher's logits are computed by the actor, from these states
        self._final_norm_output.clear()
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if len(self._final_norm_output) != 1:
            raise PackedAttentionError(
                f"teacher: expected one output of the final norm per forward, caught {len(self._final_norm_output)}"
            )
        final = self.packed_tensor(self._final_norm_output.pop(), output_args)  # (1, N, H) or (B, L, H)
        use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        key = tu.get_non_tensor_data(data=micro_batch, key=TEACHER_OUTPUT_KEY, default=None)
        hidden = _jagged_like(final, micro_batch, use_rmpad)
        rows = []
        for h, m in zip(hidden.unbind(), micro_batch[TEACHER_MASK].unbind()):
            start = h.shape[0] - m.shape[0] - 1  # position P_b - 1 predicts response token 0
            rows.append(h[start + torch.nonzero(m, as_tuple=True)[0]])
        if key is not None:
            return {key: torch.nested.as_nested_tensor(rows, layout=torch.jagged)}
        return self._encode(rows, micro_batch)

    def _encode(self, rows: list[torch.Tensor], micro_batch) -> dict[str, torch.Tensor]:
        """The supervision payload of the rows' hidden states (A_b, H) under ``memopd_transport``."""
        spec = dict(tu.get_non_tensor_data(data=micro_batch, key=TEACHER_TRANSPORT, default={"name": "hidden"}))
        name, vocab_size = spec.pop("name"), spec.pop("vocab_size", None)
        transport = get_transport(name, **spec)
        head = None
        if transport.teacher_needs_head:
            if self._memopd_head is None:  # frozen: read once per worker, in fp32 (like the actor's copy)
                path = self.model_config.local_path or self.model_config.path
                self._memopd_head = load_output_head(path).float().to(rows[0].device)
            head = self._memopd_head
        # verl's micro-batches carry the rollout temperature as a scalar or per row, (B,)
        temperature = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
        return encode_teacher_rows(transport, rows, head, vocab_size, temperature)
