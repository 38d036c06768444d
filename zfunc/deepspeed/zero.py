"""``zero.Init`` and ``zero.GatheredParameters`` with DeepSpeed's meaning, over zfunc's states.

- ``with zero.Init(): model = Net()``: the model is built on the meta device (no rank holds it);
  ``initialize`` then makes each rank's rows only (``zf.materialize.from_module``: each submodule's
  own ``reset_parameters``, seeded by its name), so the values follow the module's init
  distributions but are not those of an eager ``Net()`` (as DeepSpeed's are not either).
- ``with zero.GatheredParameters(params, modifier_rank=None):``: inside, the engine's params among
  ``params`` hold their current whole values (a collective where the state is split: every rank
  enters); with ``modifier_rank=r``, rank ``r``'s changes are broadcast on exit and written into
  the engine's state (each rank its own rows). Params not trained by an engine are left alone, except
  that a modifier on params built under ``zero.Init`` before ``initialize`` is refused: they hold no
  values, and the change would be lost.
  Cost: one ``full_params`` of the state on entry; on exit with a modifier, one broadcast per param.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import optree
import torch
import torch.distributed as dist

import zfunc as zf
from zfunc.core import placement as placement_mod
from zfunc.offloading.placement import OffloadSpec

_ENGINES: list[weakref.ref] = []  # engines initialize made in this process (GatheredParameters finds params' engine)
_TUNING = {"remote_device", "pin_memory", "mem_efficient_linear", "data_parallel_group", "sequence_data_parallel_group",
           "mpu", "module", "config_dict_or_path", "config", "param_swapper", "zero_param_parallel_group",
           "zero_quantized_weights", "zero_quantized_nontrainable_weights"}


class Init(contextlib.AbstractContextManager):
    """Build the model on the meta device; ``initialize`` materializes each rank's rows (module docstring).
    ``dtype`` other than None/float32 is refused (zfunc keeps fp32 masters; the config's precision
    sets the compute dtype); DeepSpeed's placement and tuning arguments are accepted and unused."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype | None = None, **kwargs: Any):
        unknown = sorted(set(kwargs) - _TUNING)
        if unknown:
            raise TypeError(f"zero.Init: unexpected arguments {unknown}")
        if dtype not in (None, torch.float32):
            raise ValueError(f"zero.Init(dtype=...): zfunc keeps fp32 master params (the config's fp16/bf16 sets the "
                             f"compute dtype), expected None or torch.float32, got {dtype}")
        self.enabled = enabled
        self._device = torch.device("meta")

    def __enter__(self) -> Init:
        if self.enabled:
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._device.__exit__(*exc)


def _engine_of(params: list[torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The engine training ``params`` and ``{name: param}`` of those it trains."""
    ids = {id(p) for p in params}
    for ref in reversed(_ENGINES):
        engine = ref()
        if engine is None:
            continue
        named = {n: p for n, p in engine.module.named_parameters() if id(p) in ids and p.requires_grad}
        if named:
            return engine, named
    return None, {}


class GatheredParameters(contextlib.AbstractContextManager):
    """Whole, current values of an engine's params inside the block (module docstring)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self.engine, self.named = _engine_of(self.params) if enabled else (None, {})

    def __enter__(self) -> GatheredParameters:
        if self.engine is None:
            if self.enabled and self.modifier_rank is not None and any(p.is_meta for p in self.params):
                raise RuntimeError("zero.GatheredParameters(modifier_rank=...): these params were built under "
                                   "zero.Init and no engine trains them yet, so they hold no values and a change "
                                   "made here would be lost (initialize makes each rank's rows from each module's "
                                   "reset_parameters); call deepspeed.initialize first, then gather and modify")
            return self
        engine = self.engine
        engine._require_state("zero.GatheredParameters")
        state = engine.state
        whole = state.params if state.placement is None else zf.checkpoint.full_params(state)
        with torch.no_grad():
            for name, p in self.named.items():
                if p.is_meta:  # built under zero.Init: ``.data`` cannot change device, the tensor's body can
                    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                                   requires_grad=p.requires_grad))
                p.copy_(whole[name])
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.engine is None or self.modifier_rank is None or exc[0] is not None:
            return
        engine = self.engine
        state = engine.state
        if isinstance(state.placement, OffloadSpec):
            raise NotImplementedError("zero.GatheredParameters(modifier_rank=...): writing params back into an "
                                      "offloaded state is not supported by zfunc.deepspeed")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rule = placement_mod.of(state.placement)
        paths, _, _ = optree.tree_flatten_with_path(state.params, namespace=zf.tree.NAMESPACE)
        index = {path[0]: i for i, path in enumerate(paths)}
        with torch.no_grad():
            for name, p in self.named.items():
                if world > 1:
                    dist.broadcast(p.data, src=self.modifier_rank)
                piece = state.params[name]
                rows = rule.rows(state.placement, index[name], tuple(piece.shape))
                a, b = rows.held
                whole = p.detach().float().reshape(rows.shape[0] if rows.shape else 1, -1)[a:b]
                piece.copy_(whole.reshape(piece.shape))
        engine._whole = None


def track(engine: Any) -> None:
    """Let ``GatheredParameters`` find ``engine`` by its params (held weakly)."""
    _ENGINES[:] = [r for r in _ENGINES if r() is not None] + [weakref.ref(engine)]
