"""tile: ZeRO-Infinity's memory-centric tiling -- a large operator computed as k sequential tiles.

``zf.tile`` has three forms, picked by what it is given:

- **A layer** (``nn.Linear``, ``nn.Embedding``): ``model.lm_head = zf.tile(model.lm_head, tiles=8)``
  returns a new module whose weight is split along ``dim`` of the weight into k sub-modules,
  *copies* of the original's slices (``lm_head.tiles.3.weight``). Linear: ``dim=0`` splits the out
  features (tile outputs concatenated), ``dim=1`` the in features (summed). Embedding: ``dim=0``
  splits the vocabulary rows (each index looked up in its tile), ``dim=1`` the columns. Copies, not
  views: each tile is a parameter of its own, so ``zf.shard`` stage 3 (``zf.units.by_class(
  nn.Linear)`` or ``auto``) makes each tile a unit -- gathered just before its forward, freed after
  it, re-gathered for its backward -- and the original weight can be dropped. That is where the
  memory goes: a layer's parameter working set (gathered weights, whole grads) drops from the
  whole layer to ``1 + prefetch`` tiles.
- **A model** with ``modules=[...]``: tiles the named layers in place and returns the model.
  **Tied weights** (GPT's ``lm_head.weight is wte.weight``) are tiled consistently: every layer of
  the model holding that weight is tiled along the same weight dim with the *same* tile
  parameters, so the tie survives (``lm_head.tiles.3.weight is wte.tiles.3.weight``) and each tile
  is one stage-3 unit read by both layers. Stage 3 keeps a tied unit gathered from the head's
  backward until the embedding's backward completes its grad (``zfunc.sharding.prefetch`` releases a unit once
  all its grads are in), so late in backward a tied head's tiles are whole together; an untied
  head (tile both: ``modules=["wte", "lm_head"]``) is never whole. The layer form cannot see the
  other holder, so it *refuses* a weight another module also holds (found through the garbage
  collector's referrers, ~0.1 s once) rather than untie it silently, and names the model form.
- **A function**: ``zf.tile(fn, tiles=k, dim=d)`` runs ``fn`` on k chunks of its ``argnums``
  arguments along ``d`` one after another and concatenates the outputs along ``d``, or combines
  them with ``reduce="sum"`` / ``"mean"`` (tile results weighted by tile size). With grad enabled
  each tile runs under non-reentrant ``torch.utils.checkpoint``, so only one tile's intermediates
  live at a time, forward or backward. The recomputation runs in backward, outside stage 3's
  forward hooks: under stage 3, ``fn`` must not read sharded params (use the layer form).

``materializer(fn, model)`` makes a tiled model's params from ``fn``, an init written for it untiled.
``lm_head_loss(hidden, weight, targets, tiles=k)`` is the tiled LM head + cross-entropy over token
tiles: logits of N/k tokens at a time, never the whole (N, vocab). It does not recompute (the
function form would: 4 matmuls instead of 3, ~1.3x the time): each tile's softmax grad becomes
the grads of ``hidden`` and ``weight`` in the forward pass, and backward only scales them by the
incoming grad. The mean divides by the non-ignored tokens of the whole input, so uneven tiles and
``ignore_index`` weigh as untiled. With ``mesh=`` (tensor parallelism) the weight is this rank's vocab
slice and each tile's loss the vocab-parallel cross-entropy (``zfunc.model.vocab_slice``).
``WorkingMemory`` accounts the peak bytes a region allocates (CPU has no allocator statistics): what
the tests check against the cost below.

**Law.** Every form equals the untiled op: outputs and grads agree to fp32 rounding (sums over
tiles are reordered: ~1e-7 relative); tied weights stay tied; tiled layers train as the original
under any ``zf.shard`` stage.

**Cost.** Layer forms: the same flops; tiled outputs are concatenated (one more output-sized copy,
alongside the tile outputs for a moment); a vocab-split Embedding sorts the indices and syncs once
for the tile sizes. Function form: the same flops plus one recomputed forward of ``fn``; working
memory one tile's intermediates. ``lm_head_loss``: the same three matmuls; working memory one
(N/k, vocab) fp32 tile (two for a moment) plus the grads of ``hidden`` and ``weight`` (held from
forward to backward), against ~3 (N, vocab) untiled.

``zf.tile`` is a function; ``lm_head_loss``, ``WorkingMemory``, ``TiledLinear``,
``TiledEmbedding`` and ``tile_tokens`` (an MLP over sequence tiles, ``zfunc.model.token_tiles``) hang off it
(``zf.tiling.lm_head_loss``) and import from ``zfunc.model.tiling``.
"""
from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from zfunc.core import compose
from zfunc.model import vocab_slice
from zfunc.model.materialize import Materializer, leaf as materialize_leaf
from zfunc.model.token_tiles import tile_tokens  # noqa: F401 - zf.tiling.tile_tokens

_LAYERS = (nn.Linear, nn.Embedding)


def _sizes(n: int, tiles: int) -> list[int]:
    """``tensor_split`` sizes: k tiles differing by at most one element, the larger first."""
    return [n // tiles + (i < n % tiles) for i in range(tiles)]


def _check_tiles(tiles: Any, size: int, what: str) -> None:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    if tiles > size:
        raise ValueError(f"tiles: {tiles} tiles but {what} has only {size}; use at most {size}")


# ------------------------------------------------------------------------------- the layer forms


def _param_like(src: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.detach().clone(memory_format=torch.contiguous_format), requires_grad=src.requires_grad)


class TiledLinear(nn.Module):
    """``nn.Linear`` as k sub-``Linear`` tiles of its weight along ``dim`` (0: out, 1: in features).

    Law: ``TiledLinear(lin, k, dim)(x)`` equals ``lin(x)``, grads included. Cost: the flops of
    ``lin``; ``dim=0`` concatenates the tile outputs (one extra output-sized copy), ``dim=1`` sums
    them in place. The bias lives in every out tile (``dim=0``) or in the first in tile (``dim=1``).
    """

    def __init__(self, linear: nn.Linear, tiles: int, dim: int, weights: Sequence[nn.Parameter] | None = None):
        super().__init__()
        self.in_features, self.out_features, self.dim = linear.in_features, linear.out_features, dim
        self.sizes = _sizes(linear.weight.shape[dim], tiles)
        parts = weights or [_param_like(linear.weight, w) for w in linear.weight.split(self.sizes, dim)]
        biases = (linear.bias.split(self.sizes) if dim == 0 else [linear.bias] + [None] * (tiles - 1)) \
            if linear.bias is not None else [None] * tiles
        self.tiles = nn.ModuleList(self._tile(linear, w, b) for w, b in zip(parts, biases))

    @staticmethod
    def _tile(linear: nn.Linear, weight: nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
        out_f, in_f = weight.shape
        t = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")  # meta: no random init to throw away
        t.weight = weight
        if bias is not None:
            t.bias = _param_like(linear.bias, bias)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return torch.cat([t(x) for t in self.tiles], dim=-1)
        chunks = x.split(self.sizes, dim=-1)
        out = self.tiles[0](chunks[0])
        for t, xi in zip(self.tiles[1:], chunks[1:]):
            out = out.add_(t(xi))  # in place: a Linear's backward does not read its output
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dim={self.dim}, sizes={self.sizes}"


class TiledEmbedding(nn.Module):
    """``nn.Embedding`` as k sub-``Embedding`` tiles of its weight along ``dim`` (0: vocabulary
    rows, 1: embedding columns).

    Law: ``TiledEmbedding(emb, k, dim)(idx)`` equals ``emb(idx)``, grads included (``padding_idx``
    and ``scale_grad_by_freq`` keep their meaning: an index's occurrences all reach one tile).
    Cost: ``dim=1`` concatenates; ``dim=0`` sorts the indices by tile, reads the tile sizes (one
    device sync) and puts the rows back in order (two output-sized copies). Every tile runs on
    every call, even with no index in it, so stage 3's ranks gather the same units.
    """

    def __init__(self, emb: nn.Embedding, tiles: int, dim: int, weights: Sequence[nn.Parameter] | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dim = emb.num_embeddings, emb.embedding_dim, dim
        self.sizes = _sizes(emb.weight.shape[dim], tiles)
        self.starts = [sum(self.sizes[:i]) for i in range(tiles)]
        parts = weights or [_param_like(emb.weight, w) for w in emb.weight.split(self.sizes, dim)]
        self.tiles = nn.ModuleList(self._tile(emb, w, start) for w, start in zip(parts, self.starts))

    def _tile(self, emb: nn.Embedding, weight: nn.Parameter, start: int) -> nn.Embedding:
        pad = emb.padding_idx
        if self.dim == 0:  # the padding row belongs to one tile only
            pad = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
        t = nn.Embedding(*weight.shape, padding_idx=pad, scale_grad_by_freq=emb.scale_grad_by_freq, device="meta")
        t.weight = weight
        return t

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.dim == 1:
            return torch.cat([t(idx) for t in self.tiles], dim=-1)
        if idx.is_meta:  # no tile sizes to read: each tile looks every id up (clamped into it), same shape
            return sum(t(idx.clamp(s, s + n - 1) - s) for t, s, n in zip(self.tiles, self.starts, self.sizes))
        flat = idx.reshape(-1)
        which = torch.bucketize(flat, torch.tensor(self.starts[1:], device=flat.device), right=True)
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=len(self.tiles)).tolist()
        rows = torch.cat([t(i - s) for t, i, s in zip(self.tiles, flat[order].split(counts), self.starts)])
        return rows.new_empty(rows.shape).index_copy(0, order, rows).view(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dim={self.dim}, sizes={self.sizes}"


def _tile_layer(layer: nn.Module, tiles: int, dim: Any, name: str = "module",
                weights: Sequence[nn.Parameter] | None = None) -> nn.Module:
    if type(layer) not in _LAYERS:  # subclasses may change forward: refuse rather than guess
        raise TypeError(f"{name}: zf.tile tiles nn.Linear and nn.Embedding layers, got {type(layer).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -2 <= dim <= 1:
        axes = "0 (out features) or 1 (in features)" if type(layer) is nn.Linear else "0 (rows) or 1 (columns)"
        raise ValueError(f"dim: expected {axes} of the {type(layer).__name__} weight, got {dim!r}")
    dim %= 2
    if type(layer) is nn.Embedding and (layer.max_norm is not None or layer.sparse):
        raise ValueError(f"{name}: Embedding with max_norm or sparse=True is not supported by zf.tile "
                         "(max_norm renormalizes rows in place, sparse grads have no tiled form)")
    _check_tiles(tiles, layer.weight.shape[dim], f"dim {dim} of {name}'s weight {tuple(layer.weight.shape)}")
    cls = TiledLinear if type(layer) is nn.Linear else TiledEmbedding
    return cls(layer, tiles, dim, weights)


def _other_holders(layer: nn.Module) -> list[nn.Module]:
    """Modules besides ``layer`` whose ``_parameters`` hold its weight (a tie). A module's
    ``_parameters`` dict is referred to by the module itself or by its ``__dict__``."""
    found = []
    for d in gc.get_referrers(layer.weight):
        if not isinstance(d, dict) or d is layer._parameters:
            continue
        for r in gc.get_referrers(d):
            owners = [r] if isinstance(r, nn.Module) else gc.get_referrers(r) if isinstance(r, dict) else []
            found += [m for m in owners if isinstance(m, nn.Module) and m._parameters is d]
    return found


def _tile_in_model(model: nn.Module, names: Sequence[str], tiles: int, dim: int) -> nn.Module:
    """Replace each named layer of ``model`` (and every layer tied to it) by its tiled form."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"modules: expected a list of submodule names, got {names!r}")
    done: set[str] = set()  # tiled already, as the tie of an earlier name
    for name in names:
        known = dict(model.named_modules(remove_duplicate=False))
        if name not in known or name == "":
            raise ValueError(f"modules: {name!r} is not a submodule of the model (the model itself cannot be "
                             "replaced in place: tile a layer with zf.tile(layer, tiles=k))")
        if name in done:
            continue
        target = known[name]
        tiled = _tile_layer(target, tiles, dim, f"modules[{name!r}]")
        shared = [t.weight for t in tiled.tiles]
        for qual, mod in known.items():
            if mod is target:
                _replace(model, qual, tiled)
            elif mod._parameters.get("weight") is target.weight:  # a tie: tile it with the same params
                _replace(model, qual, _tile_layer(mod, tiles, dim, f"{qual!r} (tied to {name!r})", shared))
            else:
                continue
            done.add(qual)
    return model


def _replace(model: nn.Module, qualname: str, new: nn.Module) -> None:
    parent, _, leaf = qualname.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


# ------------------------------------------------------------------------------- the function form


def _tile_function(fn: Callable, tiles: int, dim: int, reduce: str | None, argnums: Sequence[int]) -> Callable:
    @functools.wraps(fn)
    def tiled(*args: Any, **kwargs: Any) -> Any:
        split = _split_args(args, argnums, tiles, dim)
        # checkpoint saves only the tile's inputs (views) and recomputes the rest in its backward
        run = functools.partial(checkpoint, fn, use_reentrant=False) if torch.is_grad_enabled() else fn
        outs = [run(*chunk_args, **kwargs) for chunk_args, _ in split]
        return _combine(outs, [n for _, n in split], reduce, dim)

    return tiled


def _split_args(args: tuple, argnums: Sequence[int], tiles: int, dim: int) -> list[tuple[tuple, int]]:
    """Per tile: the arguments (chunked ones replaced by their views) and the tile's size."""
    size = None
    chunks: dict[int, tuple[torch.Tensor, ...]] = {}
    for i in argnums:
        if not -len(args) <= i < len(args) or not isinstance(args[i], torch.Tensor):
            raise ValueError(f"argnums: argument {i} is not a tensor of this call ({len(args)} positional args)")
        x = args[i]
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim: {dim} is out of range for argument {i} of shape {tuple(x.shape)}")
        if size is None:
            size = x.shape[dim]
            _check_tiles(tiles, size, f"dim {dim} of argument {i} (shape {tuple(x.shape)})")
        elif x.shape[dim] != size:
            raise ValueError(f"argnums: argument {i} has {x.shape[dim]} entries along dim {dim}, argument "
                             f"{argnums[0]} has {size}; the chunked arguments must agree")
        chunks[i % len(args)] = x.split(_sizes(size, tiles), dim)
    return [(tuple(chunks[i][t] if i in chunks else a for i, a in enumerate(args)), n)
            for t, n in enumerate(_sizes(size, tiles))]


def _combine(outs: list[Any], sizes: list[int], reduce: str | None, dim: int) -> Any:
    if reduce is None:
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs, dim)
        return type(outs[0])(torch.cat(parts, dim) for parts in zip(*outs))
    weights = [1.0] * len(outs) if reduce == "sum" else [n / sum(sizes) for n in sizes]
    total = outs[0] * weights[0]
    for out, w in zip(outs[1:], weights[1:]):
        total = total + out * w
    return total


# ------------------------------------------------------------------------------- LM head + loss


class _LMHeadLoss(torch.autograd.Function):
    """Tiled cross-entropy of ``hidden @ weight.T``; grads made in forward (see ``lm_head_loss``)."""

    @staticmethod
    def forward(hidden, weight, targets, tiles, ignore_index, mean, need_h, need_w, vocab):
        h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        valid = y != ignore_index
        denom = valid.sum().clamp(min=1) if mean else torch.ones((), device=y.device)
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # low-precision dW sums in fp32
        dh = torch.empty_like(h) if need_h else h.new_empty(0)
        dw = torch.zeros_like(weight, dtype=acc_dtype) if need_w else weight.new_empty(0)
        total = torch.zeros((), dtype=acc_dtype, device=h.device)
        start = 0
        for n in _sizes(h.shape[0], tiles):
            rows = slice(start, start + n)
            tile = _tile_loss if vocab is None else functools.partial(vocab_slice.tile_loss, vocab=vocab)
            total += tile(h[rows], weight, y[rows], valid[rows], denom, dh[rows] if need_h else None,
                          dw if need_w else None)
            start += n
        if vocab is not None and need_h:
            vocab_slice.sum_hidden_grads(dh, vocab)
        loss = total / valid.sum() if mean else total  # 0/0 = nan with every target ignored, as torch
        return loss, dh.view(hidden.shape) if need_h else dh, dw

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dh, dw = output
        ctx.mark_non_differentiable(dh, dw)
        ctx.save_for_backward(dh, dw)
        ctx.need, ctx.w_dtype = inputs[6:8], inputs[1].dtype  # inputs[8]: the vocab slice (no grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _dh, _dw):
        dh, dw = ctx.saved_tensors
        gh = dh * grad.to(dh.dtype) if ctx.need[0] else None
        gw = (dw * grad).to(ctx.w_dtype) if ctx.need[1] else None
        return gh, gw, None, None, None, None, None, None, None


def _tile_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor,
               dh: torch.Tensor | None, dw: torch.Tensor | None) -> torch.Tensor:
    """Summed CE of one token tile; writes its rows of ``dh`` and adds into ``dw`` when given."""
    logits = h @ w.T
    # log_softmax is one fused pass (logsumexp + subtract take several); fp32 for fp16/bf16 inputs.
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    del logits
    safe = y.masked_fill(~valid, 0)
    loss = -(logp.gather(1, safe[:, None]).squeeze(1) * valid).sum()
    if dh is None and dw is None:
        return loss
    grad = logp.exp_()  # softmax, in log_softmax's memory
    grad[torch.arange(len(y), device=y.device), safe] -= 1.0
    grad.mul_((valid / denom).to(grad.dtype)[:, None])  # ignored rows give nothing; mean's 1/count
    vocab_slice.head_grads(grad, w, h, dh, dw)
    return loss


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, tiles: int,
                 ignore_index: int = -100, reduction: str = "mean", mesh: Any = None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` without ever holding the whole logits.

    Args:
      hidden: ``(..., d)`` activations. weight: the head's ``(vocab, d)`` weight (bias-free, as in
        GPT and Llama). targets: ``(...)`` class indices; ``ignore_index`` entries count nothing.
      tiles: token tiles (at most the token count; sizes differ by at most one).
      reduction: ``"mean"`` over the non-ignored tokens of the whole input (not per tile) or ``"sum"``.
      mesh: a ``zf.Mesh`` with ``tp > 1`` when ``weight`` is this rank's vocab slice (``zf.tensor_parallel``'s
        "vocab" head: rows ``[rank * per, (rank + 1) * per)`` of the vocabulary padded to ``tp * per``);
        every rank of the tp group calls with the same ``hidden`` and ``targets`` (ids in the whole
        vocabulary), and each tile's loss is the vocab-parallel cross-entropy (``zfunc.model.vocab_slice``):
        the loss, ``hidden``'s grad and this rank's rows of the weight's grad are the whole head's.
      vocab_size: with ``mesh``, the whole vocabulary (default ``tp * per``: no padding rows).
    Law: loss and grads of ``hidden`` and ``weight`` equal the untiled expression (fp32 rounding;
    ``nan`` loss and zero grads when every target is ignored, as torch). The loss is fp32 for
    fp16/bf16 inputs (softmax in fp32). Not twice differentiable.
    Cost: three matmuls like the untiled op, no recomputation; memory: one ``(N/k, vocab)`` fp32
    tile (two for a moment: the logits and their log-softmax) and the grads of ``hidden`` and
    ``weight``, computed in forward and held until backward. Under stage 3 ``weight`` must be whole
    where this runs (it reaches no module's forward hook): there, tile the head module instead.
    """
    for arg, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}: expected a tensor, got {type(t).__name__}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected shape (vocab, {hidden.shape[-1] if hidden.dim() else '?'}) for hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1] or targets.is_floating_point():
        raise ValueError(f"targets: expected integer class indices of shape {tuple(hidden.shape[:-1])}, "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    _check_tiles(tiles, targets.numel(), f"hidden (shape {tuple(hidden.shape)}) in tokens")
    if mesh is None and vocab_size is not None:
        raise ValueError(f"vocab_size: names the vocabulary of a vocab-sliced weight, with mesh=; got {vocab_size!r} "
                         "without a mesh")
    vocab = None if mesh is None or getattr(mesh, "tp", 1) == 1 else vocab_slice.of_mesh(mesh, weight.shape[0],
                                                                                          vocab_size)
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    out = _LMHeadLoss.apply(hidden, weight, targets, tiles, ignore_index, reduction == "mean", need_h, need_w, vocab)
    return out[0]


# ------------------------------------------------------------------------------- accounting


class WorkingMemory(TorchDispatchMode):
    """Accounted working bytes of a region: ``with WorkingMemory() as mem: ...; mem.peak_bytes``.

    Counts the storages that operators create inside the region (forward and backward: the
    autograd engine runs the ops under the same mode) while they are alive; tensors that existed
    before (params, inputs) and views or in-place results of them are not counted. The peak is
    sampled after each operator, so a kernel's internal scratch is not seen. CPU has no allocator
    statistics; this is the stand-in tests check. Cost: a Python call per operator -- for
    measuring, not for training.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t.untyped_storage(), inputs)
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.current_bytes = sum(n for _, n in self._live.values())
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _note(self, storage, inputs: set[int]) -> None:
        ref = StorageWeakRef(storage)
        known = self._live.get(ref.cdata)
        if known is not None and not known[0].expired():
            self._live[ref.cdata] = (known[0], storage.nbytes())  # resized in place
        elif ref.cdata not in inputs:  # new memory, not an input returned (in place) or viewed
            self._live[ref.cdata] = (ref, storage.nbytes())


# ------------------------------------------------------------------------------- the entry point


def tile(module_or_fn: nn.Module | Callable, *, tiles: int, dim: int = 0, reduce: str | None = None,
         argnums: int | Sequence[int] | None = None, modules: Sequence[str] | None = None) -> Any:
    """Memory-centric tiling of a layer, of a model's named layers, or of a function.

    Args:
      module_or_fn: an ``nn.Linear`` / ``nn.Embedding`` (returns its tiled copy), a model with
        ``modules`` (tiles those layers in place, ties kept; returns the model), or a callable.
      tiles: k >= 1, at most the size being split.
      dim: layers: the weight dim to split (Linear 0 = out, 1 = in features; Embedding 0 = rows,
        1 = columns). Function: the dim of the chunked arguments and of the concatenated output.
      reduce: function form: ``None`` (concatenate), ``"sum"`` or ``"mean"`` (weighted by tile size).
      argnums: function form: positional arguments to chunk (default ``0``); the others go whole
        to every tile.
      modules: model form: qualified names of the layers to tile.
    Law and cost: see the module docstring. Errors name the argument at fault.
    """
    if isinstance(module_or_fn, nn.Module):
        for arg, value in (("reduce", reduce), ("argnums", argnums)):
            if value is not None:
                raise ValueError(f"{arg}: only the function form takes it; a layer's tiles are combined by its dim")
        if modules is not None:
            return _tile_in_model(module_or_fn, modules, tiles, dim)
        layer = _tile_layer(module_or_fn, tiles, dim)
        holders = _other_holders(module_or_fn)
        if holders:
            raise ValueError(f"module: its weight is also held by {type(holders[0]).__name__} (a tied weight); "
                             "tiling this layer alone would untie them. Tile through the model, which tiles "
                             "both with shared tiles: zf.tile(model, tiles=k, modules=['lm_head'])")
        return layer
    if not callable(module_or_fn):
        raise TypeError(f"module_or_fn: expected an nn.Linear, nn.Embedding, a model or a callable, "
                        f"got {type(module_or_fn).__name__}")
    compose.check_model_level("tile", module_or_fn)
    if modules is not None:
        raise ValueError("modules: only a model's layers can be named; got a function")
    if reduce not in (None, "sum", "mean"):
        raise ValueError(f"reduce: expected None, 'sum' or 'mean', got {reduce!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {dim!r}")
    argnums = (0,) if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not argnums or not all(isinstance(i, int) for i in argnums):
        raise ValueError(f"argnums: expected an int or a non-empty sequence of ints, got {argnums!r}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    return _tile_function(module_or_fn, tiles, dim, reduce, argnums)


def materializer(fn: Materializer, model: nn.Module) -> Materializer:
    """``fn``, written for a model's untiled layers, as the materializer of ``model`` after ``zf.tile``
    split some of them: a tile's leaf ``LAYER.tiles.I.KIND`` is its part of the whole layer's leaf
    ``LAYER.KIND`` as ``fn`` makes it -- a tile along dim 0 its rows, along dim 1 its columns (and the
    bias, which tile 0 holds whole) -- and every other leaf is ``fn``'s. So one init rule serves the model
    tiled or not, and both start from the same values. A leaf is a tile's when its module is a
    ``TiledLinear`` / ``TiledEmbedding`` tile (looked up in ``model`` when the leaf is asked for).

    Law: as the module docstring's, for ``fn``'s law holds for the whole leaf. Cost: a dim-0 tile's
    rows asked for; a dim-1 tile's rows at the whole layer's width (the other tiles' columns are
    made and dropped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected the (tiled, meta-device) nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError(f"fn: expected a materializer materialize(name, like[, rows]), got {type(fn).__name__}")

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        found = _tile_of(model, name)
        if found is None:
            return materialize_leaf(fn, name, like, rows)
        whole_name, layer, index = found
        start, size = sum(layer.sizes[:index]), layer.sizes[index]
        mine = rows or slice(0, like.shape[0] if like.dim() else 1)
        if like.dim() == 2 and layer.dim == 1:  # a slice of the columns: the whole rows, cut
            whole = torch.empty((like.shape[0], sum(layer.sizes)), dtype=like.dtype, device="meta")
            return materialize_leaf(fn, whole_name, whole, mine)[:, start : start + size].contiguous()
        if layer.dim == 1:  # the bias of an in-features tile: the layer's whole bias
            return materialize_leaf(fn, whole_name, like, rows)
        whole = torch.empty((sum(layer.sizes), *like.shape[1:]), dtype=like.dtype, device="meta")
        return materialize_leaf(fn, whole_name, whole, slice(start + mine.start, start + mine.stop))

    return materialize


def _tile_of(model: nn.Module, name: str) -> tuple[str, nn.Module, int] | None:
    """For a tile's leaf ``LAYER.tiles.I.KIND``: the whole layer's leaf name ``LAYER.KIND``, the tiled
    layer and ``I``; None for any other leaf."""
    owner, _, kind = name.rpartition(".")
    tiles, _, index = owner.rpartition(".")
    path, _, attr = tiles.rpartition(".")
    if attr != "tiles" or not index.isdigit():
        return None
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(layer, (TiledLinear, TiledEmbedding)) or int(index) >= len(layer.sizes):
        return None
    return (f"{path}.{kind}" if path else kind), layer, int(index)
