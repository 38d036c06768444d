"""``plan=None``: the tensor-parallel plan found from the module graph, with no table per architecture.

One forward of the model on a few tokens (``example``, default 8 zeros; on the params' device, the
meta device included) is recorded op by op (a ``TorchFunctionMode``: each op's input and output
tensors) with forward hooks on every projection (``nn.Linear``, transformers' ``Conv1D``) and
embedding. From that data flow:

- **rowwise**: a projection B whose input, followed back through the ops that made it, comes from
  other projections' outputs and from tensors that need no grad (rotary tables, masks) only: no
  path back reaches a param or a tensor made from the residual stream without passing through a
  projection. That is the input of an attention output (heads of q, k, v through attention) or of
  an MLP's down projection (the activation of the up and gate projections).
- **colwise**: the projections those paths reach (q, k, v; up, gate). Fused outputs (``k`` parts
  sliced each): the first op on the output splits it into ``k`` equal pieces along its last dim, or
  reshapes it with ``k`` leading the head dims (``view(B, T, 3, H, d)``); a head-major fused output
  (``view(B, T, H, 3 d)``, GPT-NeoX) is one part.
- **vocab**: the largest embedding looked up by the model's integer input, and every projection
  whose output width is its vocabulary (the LM or MLM head, tied or not); a layer ``zf.tile`` split
  along its rows counts as the layer it tiles (its tiles are then sliced one by one:
  ``zfunc.tensor.transform.tiled_styles``).
- everything else is replicated (norms, position embeddings, pooler and head transforms).

The owner of each colwise projection gets its head counts divided (``zfunc.tensor.plan``); a head
count tp does not divide is refused naming the module. Cost: one forward on ``example`` with
every op's tensors kept alive until the walk is done.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zfunc.model.tiling import TiledEmbedding, TiledLinear
from zfunc.tensor.layers import matmul_kind

_SPLITS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
_SHAPES = {"view", "reshape", "unflatten"}


class _Recorder(TorchFunctionMode):
    """Every op's (name, input tensors, output tensors, args), outputs mapped to their op."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[torch.Tensor], list[torch.Tensor], tuple]] = []
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        ins = [t for t in _tensors(args) + _tensors(tuple(kwargs.values()))]
        outs = _tensors((out,))
        index = len(self.ops)
        self.ops.append((name, ins, outs, args[1:] if args else ()))
        for t in outs:
            self.producer.setdefault(id(t), index)
        for t in ins:
            self.consumers.setdefault(id(t), []).append(index)
        return out


def _tensors(values: tuple) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(tuple(v)))
    return out


def find_plan(model: nn.Module, tp: int, example: Any = None) -> dict[str, str]:
    """The plan for ``model`` (see the module docstring): module name -> style, every module named
    exactly. Raises ``ValueError`` naming the model when it finds no projection to slice."""
    tiled = {n: m for n, m in model.named_modules() if isinstance(m, (TiledLinear, TiledEmbedding)) and m.dim == 0}
    inside = lambda n: any(n.startswith(t + ".") for t in tiled)  # noqa: E731 - a tile: its tiled layer stands for it
    projections = {n: m for n, m in model.named_modules() if matmul_kind(m) is not None and not inside(n)}
    embeddings = {n: m for n, m in model.named_modules()
                  if isinstance(m, nn.Embedding) and not inside(n) or isinstance(tiled.get(n), TiledEmbedding)}
    heads = {**projections, **{n: m for n, m in tiled.items() if isinstance(m, TiledLinear)}}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [m.register_forward_hook(_keep(seen, n)) for n, m in {**projections, **embeddings}.items()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if example is None:
        example = torch.zeros(1, 8, dtype=torch.long, device=device)
    recorder = _Recorder()
    try:
        with torch.enable_grad(), recorder:
            model(example)
    finally:
        for h in hooks:
            h.remove()
    plan: dict[str, str] = {}
    outputs = {id(out): name for name, (_, out) in seen.items() if name in projections}
    for name in projections:
        if name not in seen:
            continue
        sources = _sources(seen[name][0], outputs, recorder)
        if sources:
            plan[name] = "rowwise"
            for source in sources:
                parts = _parts(seen[source][1], recorder)
                plan[source] = "colwise" if parts == 1 else f"colwise:{parts}"
    vocab = _vocab(embeddings, seen, example, recorder)
    if vocab is not None:
        plan[vocab] = "vocab"
        rows = embeddings[vocab].num_embeddings
        for name, m in heads.items():
            width = m.out_features if isinstance(m, (nn.Linear, TiledLinear)) else None
            if width == rows and name not in plan:
                plan[name] = "vocab"
    if not any(style.startswith("colwise") for style in plan.values()):
        raise ValueError(f"tensor_parallel: plan=None found no column-/row-parallel pair in {type(model).__name__} "
                         "(no projection whose input comes from other projections only); give an explicit plan")
    return {_exact(n): s for n, s in plan.items()}


def _exact(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _keep(seen: dict, name: str):
    def hook(module, args, out):
        if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) and name not in seen:
            seen[name] = (args[0], out)

    return hook


def _sources(start: torch.Tensor, outputs: dict[int, str], rec: _Recorder) -> set[str]:
    """The projections whose outputs ``start`` is made of, or an empty set when it is also made of a
    param or the residual stream (a tensor that needs grad with no projection on its path)."""
    found, todo, visited = set(), [start], set()
    while todo:
        t = todo.pop()
        if id(t) in visited:
            continue
        visited.add(id(t))
        if id(t) in outputs:
            found.add(outputs[id(t)])
            continue
        if not t.requires_grad:
            continue  # constants: masks, rotary tables
        op = rec.producer.get(id(t))
        if op is None:
            return set()  # a param, or an input that needs grad
        name, ins, _, _ = rec.ops[op]
        if name in ("linear", "addmm", "embedding", "layer_norm", "rms_norm", "group_norm"):
            return set()  # a projection not hooked, a lookup or a norm: the replicated stream
        todo.extend(ins)
    return found


def _parts(out: torch.Tensor, rec: _Recorder) -> int:
    """How many fused outputs ``out`` holds (see the module docstring)."""
    width = out.shape[-1]
    for op in rec.consumers.get(id(out), []):
        name, _, results, args = rec.ops[op]
        if name in _SPLITS:
            sizes = {r.shape[-1] for r in results if r.dim() == out.dim()}
            if len(results) > 1 and len(sizes) == 1 and sum(r.shape[-1] for r in results) == width:
                return len(results)
        if name in _SHAPES:
            shape = results[0].shape
            trailing, product = [], 1
            for d in reversed(shape):
                if product == width:
                    break
                trailing.insert(0, d)
                product *= d
            if product == width and len(trailing) >= 3:
                return trailing[0]
            return 1
    return 1


def _vocab(embeddings: dict[str, nn.Embedding], seen: dict, example: Any, rec: _Recorder) -> str | None:
    """The largest embedding that looks up the model's integer input (or a view of it)."""
    looked_up = [n for n in embeddings if n in seen and _made_from(seen[n][0], example, rec)]
    return max(looked_up, key=lambda n: embeddings[n].num_embeddings, default=None)


def _made_from(t: torch.Tensor, source: torch.Tensor, rec: _Recorder) -> bool:
    """Whether ``t`` is ``source`` or made from it by shape ops alone."""
    while t is not source:
        op = rec.producer.get(id(t))
        if op is None or rec.ops[op][0] not in (*_SHAPES, "contiguous", "__getitem__", "to") or not rec.ops[op][1]:
            return False
        t = rec.ops[op][1][0]
    return True
