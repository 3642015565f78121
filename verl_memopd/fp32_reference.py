"""The RCE audit's fp32 reference: a low-precision model's forward computed in fp32, sharded or not (pure torch).

The bf16 / fp16 rule (``verl_memopd.rce``) compares the packed pass with an fp32 reference of the **same
weights**: the weights exactly as the low-precision pass uses them (rounded to its dtype), every product,
norm and softmax in fp32. :func:`fp32_replica` yields a module that computes that forward:

* an unsharded model: the model itself, its fp16 / bf16 parameters and buffers upcast in place for the block
  and put back bit for bit (:func:`upcast_to_fp32`);
* a model sharded by FSDP (FSDP1 ``FullyShardedDataParallel`` or FSDP2 ``fully_shard``), which is how verl
  trains: the sharded parameters cannot be upcast, and FSDP's mixed precision casts them to bf16 at every
  forward. The replica is then a copy of the Hugging Face model on the ``meta`` device (no memory), one
  module per FSDP unit, whose weights are filled in unit by unit from the fp32 shards FSDP keeps (FSDP2:
  ``DTensor.full_tensor``; FSDP1: ``summon_full_params``), rounded to the compute dtype, just before the unit
  runs and released right after it, as FSDP itself does. Peak extra memory: the root unit's parameters
  (embeddings, final norm, head) plus one unit's, in fp32. Every data-parallel rank must run it the same
  number of times (it gathers with collectives), as it does FSDP's own forward.

Everything here reads public torch APIs (``FSDPModule.reshard``, ``DTensor``, ``summon_full_params``); the
FSDP instance each parameter belongs to is found from the module tree.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["Fp32ReferenceError", "sharding", "upcast_to_fp32", "fp32_replica"]

#: wrapper attributes FSDP1 / activation checkpointing insert into parameter names
_WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
LOW_PRECISION = (torch.float16, torch.bfloat16)


class Fp32ReferenceError(RuntimeError):
    """The fp32 reference could not be built from the sharded model (a parameter it cannot find)."""


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)


def _is_fsdp1(m: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(m, FullyShardedDataParallel)


def _fsdp2_class() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return FSDPModule


def _is_fsdp2(m: nn.Module) -> bool:
    return isinstance(m, _fsdp2_class())


def sharding(module: nn.Module) -> str:
    """``"fsdp1"``, ``"fsdp2"`` or ``"none"``: how ``module``'s parameters are managed."""
    if not torch.distributed.is_available():
        return "none"
    modules = list(module.modules())
    if any(_is_fsdp1(m) for m in modules):
        return "fsdp1"
    if any(_is_fsdp2(m) for m in modules):
        return "fsdp2"
    return "none"


@contextmanager
def upcast_to_fp32(model: nn.Module) -> Iterator[bool]:
    """Run an unsharded ``model`` in fp32 inside the block: every fp16 / bf16 parameter and buffer is upcast in
    place and put back exactly afterwards (a low-precision value survives the round trip bit for bit). Yields
    False (and changes nothing) when FSDP manages the parameters (use :func:`fp32_replica`)."""
    if sharding(model) != "none" or hasattr(model, "_fsdp_wrapped_module"):
        yield False
        return
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.dtype in LOW_PRECISION]
    dtypes = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.float()
    try:
        yield True
    finally:
        for t, dt in zip(tensors, dtypes):
            t.data = t.data.to(dt)


def _meta_copy(hf_model: nn.Module) -> nn.Module:
    """The Hugging Face model's class (FSDP2 swaps in a subclass: its plain base) built from a copy of its config
    on the ``meta`` device, in fp32, eval mode."""
    from transformers import PreTrainedModel

    cls = next(
        (c for c in type(hf_model).__mro__ if issubclass(c, PreTrainedModel) and not issubclass(c, _fsdp2_class())),
        None,
    )
    if cls is None:
        raise Fp32ReferenceError(f"fp32 reference: {type(hf_model).__name__} is not a Hugging Face model")
    with torch.device("meta"):
        # sdpa: the replica runs only the audit's stock-attention alone pass (``audit._run_alone`` sets it again)
        replica = cls._from_config(copy.deepcopy(hf_model.config), dtype=torch.float32, attn_implementation="sdpa")
    return replica.eval()


def _units(hf_model: nn.Module, kind: str) -> dict[str, nn.Module]:
    """The FSDP units inside ``hf_model`` by clean name ("" = the root), in forward (pre-)order. FSDP1's root
    wraps ``hf_model`` from outside; the root unit is then not in this map (the caller adds it)."""
    is_unit = _is_fsdp1 if kind == "fsdp1" else _is_fsdp2
    units: dict[str, nn.Module] = {}
    for name, m in hf_model.named_modules():
        if is_unit(m):
            units.setdefault(_clean(name), m)
    return units


def _owner(name: str, units: dict[str, nn.Module]) -> str:
    """The innermost unit containing the parameter or module ``name`` (clean)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in units:
            return prefix
    return ""


def _full_fp32(p: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The full value of a parameter (a DTensor shard is gathered, on ``device``; a CPU-offloaded shard is moved
    there first), rounded to ``dtype`` and returned in fp32."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = p.to_local()
        if local.device != device:
            p = DTensor.from_local(
                local.to(device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        p = p.full_tensor()
    return p.detach().to(device=device, dtype=dtype).float()


class _Filler:
    """Fills the meta replica's parameters of one unit from the sharded model, and empties them again."""

    def __init__(
        self,
        replica: nn.Module,
        hf_model: nn.Module,
        wrapper: nn.Module,
        kind: str,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.replica, self.kind, self.device, self.dtype = replica, kind, device, dtype
        self.units = _units(hf_model, kind)
        self.root = wrapper if kind == "fsdp1" else hf_model
        if kind == "fsdp2":
            for unit in list(self.units.values()) + [hf_model]:
                if _is_fsdp2(unit):
                    unit.reshard()  # every registered parameter is now its fp32 DTensor shard
            self.sharded = {_clean(n): p for n, p in hf_model.named_parameters(remove_duplicate=False)}
        # per unit: its parameter names in the replica, tied parameters once (name -> every (module, leaf) and
        # the meta parameter there, put back on release)
        self.names: dict[str, dict[str, list[tuple[nn.Module, str, nn.Parameter]]]] = {}
        seen: dict[int, str] = {}
        for name, param in replica.named_parameters(remove_duplicate=False):
            mod_name, _, leaf = name.rpartition(".")
            first = seen.setdefault(id(param), name)
            places = self.names.setdefault(_owner(first, self.units), {}).setdefault(first, [])
            places.append((replica.get_submodule(mod_name), leaf, param))

    def _values(self, unit: str) -> dict[str, torch.Tensor]:
        wanted = self.names.get(unit, {})
        if self.kind == "fsdp2":
            missing = [n for n in wanted if n not in self.sharded]
            if missing:
                raise Fp32ReferenceError(f"fp32 reference: the FSDP2 model has no parameter {missing[0]!r}")
            return {n: _full_fp32(self.sharded[n], self.device, self.dtype) for n in wanted}
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        module = self.root if unit == "" else self.units[unit]
        prefix = unit + "." if unit else ""
        out = {}
        with FSDP.summon_full_params(module, recurse=False, writeback=False):
            for n, p in module.named_parameters(remove_duplicate=False):
                name = prefix + _clean(n)
                if name in wanted and _owner(name, self.units) == unit:
                    out[name] = _full_fp32(p, self.device, self.dtype)
        missing = [n for n in wanted if n not in out]
        if missing:
            raise Fp32ReferenceError(
                f"fp32 reference: the FSDP1 unit {unit or '<root>'!r} has no parameter {missing[0]!r}"
            )
        return out

    def fill(self, unit: str) -> None:
        for name, value in self._values(unit).items():
            param = nn.Parameter(value, requires_grad=False)
            for mod, leaf, _ in self.names[unit][name]:
                setattr(mod, leaf, param)

    def release(self, unit: str) -> None:
        for places in self.names.get(unit, {}).values():
            for mod, leaf, meta in places:
                setattr(mod, leaf, meta)


def _buffers_from(replica: nn.Module, hf_model: nn.Module, device: torch.device) -> None:
    """The replica's buffers (rotary frequencies, ...) from the model's, on ``device``; low precision -> fp32.
    FSDP does not shard buffers."""
    buffers = {_clean(n): b for n, b in hf_model.named_buffers(remove_duplicate=False)}
    for name, _ in list(replica.named_buffers(remove_duplicate=False)):
        if name not in buffers:
            raise Fp32ReferenceError(f"fp32 reference: the model has no buffer {name!r}")
        mod_name, _, leaf = name.rpartition(".")
        b = buffers[name].detach().to(device)
        setattr(replica.get_submodule(mod_name), leaf, b.float() if b.dtype in LOW_PRECISION else b)


@contextmanager
def fp32_replica(
    module: nn.Module, hf_model: nn.Module, dtype: torch.dtype, device: torch.device
) -> Iterator[Optional[nn.Module]]:
    """A module computing ``hf_model``'s forward in fp32 with its weights rounded to ``dtype`` (the
    low-precision pass's); ``module`` is the model as the engine calls it (FSDP1 wraps ``hf_model`` from
    outside; FSDP2 and no sharding: ``module is hf_model``). Unsharded: ``hf_model`` itself, upcast in place
    for the block. Sharded: a replica filled unit by unit (module docstring); FSDP2 units are left resharded
    (their next forward gathers again). Yields None only for a module that carries an FSDP1 wrapper attribute
    (``_fsdp_wrapped_module``) without being an FSDP instance: nothing here can upcast it."""
    kind = sharding(module)
    if kind == "none":
        with upcast_to_fp32(hf_model) as upcast:
            yield hf_model if upcast else None
        return
    replica = _meta_copy(hf_model)
    filler = _Filler(replica, hf_model, module, kind, device, dtype)
    handles = []
    for name, unit in filler.units.items():
        if name == "" or name not in filler.names:
            continue
        target = replica.get_submodule(name)
        handles.append(target.register_forward_pre_hook(lambda m, a, n=name: filler.fill(n)))
        handles.append(target.register_forward_hook(lambda m, a, o, n=name: filler.release(n)))
    try:
        _buffers_from(replica, hf_model, device)
        filler.fill("")
        yield replica
    finally:
        for h in handles:
            h.remove()
        filler.release("")
