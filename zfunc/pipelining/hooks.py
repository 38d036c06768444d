"""The hooks a pipeline stage puts on the unchanged model for one microbatch's forward of one
virtual stage (``_StageRun``, registered with ``zfunc.model.functional.run_by``): other stages'
units become the identity, the stage's first unit takes the received activation, a stage before
the last stops after its last unit by raising ``_StageOutput``. A unit's call within its own call
(``zf.remat``'s checkpointed forward runs the module again, inside) counts once. The rules are in
``zfunc.pipelining.step``'s docstring; cost: two hooks per unit of the stage per forward.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from zfunc.pipelining.layout import Layout


def unit_modules(model: nn.Module, layout: Layout) -> list[nn.Module]:
    """The modules of ``layout``'s units in ``model``, in order."""
    return [model.get_submodule(n) for n in layout.units]


class _StageOutput(BaseException):
    """Stops a non-last stage's forward after its last unit. A ``BaseException``, so a loss
    function's ``except Exception`` cannot swallow it."""

    def __init__(self, output: torch.Tensor):
        super().__init__("pipeline stage output")
        self.output = output


class _StageRun:
    """Hooks one rank puts on the model for one microbatch's forward of virtual stage ``stage``
    (of ``stages``; see the module docstring)."""

    def __init__(self, model: nn.Module, layout: Layout, stage: int, stages: int, act_in: torch.Tensor | None,
                 subs: list[nn.Module] | None = None):
        self.model, self.layout, self.stage, self.stages, self.act_in = model, layout, stage, stages, act_in
        self.subs = unit_modules(model, layout) if subs is None else subs  # ``unit_modules(model, layout)``
        self.first, self.last = layout.bounds[stage]
        self.seen, self.boundary, self.calls = 0, None, 0
        self.inside: dict[int, int] = {}  # unit -> calls of it under way (zf.remat's wrapper calls it again)

    @contextmanager
    def running(self, module: nn.Module):
        if module is not self.model:
            raise ValueError(f"pipeline: loss_fn ran a {type(module).__name__}, not the model given to "
                             f"zf.pipeline(model=...) (a {type(self.model).__name__})")
        self.calls += 1
        if self.calls > 1:
            raise ValueError("pipeline: loss_fn ran the model more than once per microbatch")
        handles, skipped = [], []
        try:
            for k, sub in enumerate(self.subs):
                if self.first <= k <= self.last:
                    handles.append(sub.register_forward_pre_hook(self._enter(k)))
                    handles.append(sub.register_forward_hook(self._leave(k)))
                else:  # the instance's attribute, where nn.Module.__setattr__ puts a function (without its checks)
                    skipped.append((sub, sub.__dict__.get("forward")))
                    sub.__dict__["forward"] = self._skip(k)
            yield
        finally:
            for h in handles:
                h.remove()
            for sub, forward in skipped:
                if forward is None:
                    del sub.__dict__["forward"]
                else:
                    sub.__dict__["forward"] = forward

    def _arrive(self, k: int) -> None:
        units = self.layout.units
        if k != self.seen:
            expected = f"'{units[self.seen]}'" if self.seen < len(units) else "no more units"
            raise ValueError(f"pipeline: units must run once each, in module order; unit '{units[k]}' ran "
                             f"when {expected} was due")
        self.seen += 1

    def _skip(self, k: int):
        def identity(*args, **kwargs):
            self._arrive(k)
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError(f"pipeline: unit '{self.layout.units[k]}' must take the activation as its "
                                 "first positional argument")
            if k == self.first - 1:
                self.boundary = args[0]
            return args[0]

        return identity

    def _enter(self, k: int):
        def hook(module, args):
            depth = self.inside.get(k, 0)
            self.inside[k] = depth + 1
            if depth:  # the unit's own call within its call (zf.remat's checkpointed forward): seen already
                return None
            self._arrive(k)
            if k != self.first or self.act_in is None:
                return None
            if not args or args[0] is not self.boundary:
                units = self.layout.units
                raise ValueError(f"pipeline: unit '{units[k]}' (first of stage {self.stage}) must get the output "
                                 f"of unit '{units[k - 1]}' unchanged as its first argument: code between two "
                                 "units cannot be split across stages")
            return (self.act_in, *args[1:])

        return hook

    def _leave(self, k: int):
        def hook(module, args, output):
            self.inside[k] -= 1
            if self.inside[k] or k != self.last or self.stage == self.stages - 1:
                return None
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"pipeline: unit '{self.layout.units[k]}' (last of stage {self.stage}) must "
                                f"return one tensor to send to the next stage, got {type(output).__name__}")
            raise _StageOutput(output)

        return hook

    def check_complete(self) -> None:
        """After a forward that returned normally (only the last stage's may): every unit ran."""
        if self.calls == 0:
            raise ValueError("loss_fn: the pipeline needs the loss to run the model through the apply "
                             "of zf.functionalize(model)")
        if self.seen != len(self.layout.units):
            raise ValueError(f"pipeline: unit '{self.layout.units[self.seen]}' never ran in stage {self.stage}'s "
                             "forward (the loss must run every pipeline unit, once, in module order)")
