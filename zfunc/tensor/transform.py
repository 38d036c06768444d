"""``zf.tensor_parallel(model, mesh, plan)``: the model's layers sliced over the mesh's tp ranks, in place.

Law: on every rank of a tp group the sliced model computes the outputs of the whole one (logits
gathered; within fp32 rounding of the all-reduces' order), the grads of a sliced param are the
matching slice of the whole param's grads, and those of a replicated param (norms, biases of
row-parallel layers, position embeddings) are the whole grads on every rank. So a plain
``zf.train_step`` on every rank trains the model as one process trains the whole one; the step over
it that knows its slices (``zf.tensor_parallel.step``) also takes the grad norm over the tp group
and gives its state a placement, so checkpoints hold whole params.

Cost per rank, a transformer of ``L`` blocks, width ``d``, ``T`` tokens per microbatch, fp32
activations (``A = 4 T d`` bytes): params and their grads and optimizer state divide by tp for the
sliced layers (attention and MLP projections, the vocab's rows), replicated ones (norms, biases of
rowwise layers, positions) are held whole. Communication (``Comm`` bytes: an all-reduce counts
twice its tensor): each block's attention and MLP each all-reduce once in forward (the rowwise
output) and once in backward (the colwise input's grad): ``4 * 2A`` per block per microbatch, plus
the embedding's forward all-reduce (``2A``), the LM head's input grad (``2A``) and the logits'
all-gather (``tp * T * V_padded / tp * 4`` bytes, the whole logits).
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from zfunc.dist.mesh import Mesh
from zfunc.model.tiling import TiledEmbedding, TiledLinear
from zfunc.tensor import layers
from zfunc.tensor.collectives import Group
from zfunc.tensor.layout import Layout, layout_of, record
from zfunc.tensor.plan import head_patches, kv_replication, match, patch


def tensor_parallel(model: nn.Module, mesh: Mesh, plan: Mapping[str, str] | None = None, *,
                    gather_logits: bool = True, sequence_parallel: bool = False) -> nn.Module:
    """Slice ``model``'s layers over ``mesh``'s tp group, in place; returns ``model`` (same class).

    Attention heads are split over the tp ranks; grouped-query kv heads too where tp divides them,
    else (tp divides the query heads only) the key and value projections are replicated, each rank
    keeping the kv heads its query heads read (``zfunc.tensor.plan``, ``zfunc.tensor.layers.replicated_kv``:
    their grads are all-reduced over tp in backward).

    Args:
      model: an ``nn.Module``, whole (CPU or meta device), not yet functionalized; every rank of the
        tp group passes the same model (same init).
      mesh: a ``zf.Mesh(..., tp=N)``; its ``tp_comm`` carries the collectives.
      plan: module-name glob patterns -> "colwise" / "colwise:k" / "rowwise" / "vocab" /
        "replicate" (``zfunc.tensor.plan``). None: the plan is found from the module graph
        (``zfunc.tensor.auto``).
      gather_logits: the vocab-parallel LM head returns the whole logits (default: any loss works);
        False: each rank's vocab slice, for ``zf.tensor_parallel.cross_entropy``.
      sequence_parallel: Megatron's sequence parallelism: between the tp regions (norms, dropout,
        residual adds) each rank holds ``T / tp`` of the tokens (dim -2 of the activations, ``T`` a
        multiple of tp); the regions are entered by an all-gather of the tokens and left by a
        reduce-scatter, instead of all-reduces; replicated lookups (positions) are cut to this rank's
        tokens. The activations between the regions divide by tp; the replicated params' grads are
        each rank's share, which ``zf.tensor_parallel.step`` sums over the tp group (one all-reduce).
        For models whose ops between the regions act per token (a pooler reading token 0 does not)
        and whose attention takes its tokens from the projections' outputs (the recipes' models do;
        transformers' attention reshapes by its input's shape, T / tp, and fails).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if layout_of(model) is not None:
        raise ValueError(f"model: this {type(model).__name__} is tensor-parallel already; slice a model once")
    for flag, value in (("gather_logits", gather_logits), ("sequence_parallel", sequence_parallel)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag}: expected a bool, got {value!r}")
    tp, rank = getattr(mesh, "tp", None), getattr(mesh, "tp_rank", None)
    if not isinstance(tp, int):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    if plan is None:
        from zfunc.tensor.auto import find_plan

        plan = find_plan(model, tp)
    styles = tiled_styles(model, match(model, plan), gather_logits, sequence_parallel)
    layout = Layout(tp, rank, styles={n: s if p == 1 else f"{s}:{p}" for n, (s, p) in styles.items()},
                    comm=mesh.tp_comm, sequence_parallel=sequence_parallel)
    group = Group(mesh.tp_comm, tp, rank, sequence_parallel)
    slicer = layers.Slicer(layout, model)
    modules = dict(model.named_modules())
    owners = sorted({name.rpartition(".")[0] for name, (style, _) in styles.items() if style == "colwise"})
    kvs = {o: kv_replication(modules[o], _widths(modules, styles, o), tp) for o in owners}
    patches = {o: head_patches(modules[o], o or type(model).__name__, tp, kvs[o]) for o in owners}  # checked first
    layout.patched = {o: p for o, p in patches.items() if p}
    replicated = {name: kv for kv in kvs.values() if kv is not None for name in kv.names}
    for name, (style, parts) in styles.items():
        module = modules[name]
        if name in replicated:
            kv = replicated[name]
            layers.replicated_kv(module, name, group, kv.kv_heads, kv.head_dim, kv.keep(rank, tp))
            layout.styles[name] = "replicated-kv"
        elif style == "colwise":
            layers.colwise(module, name, group, slicer, parts)
        elif style == "rowwise":
            layers.rowwise(module, name, group, slicer)
        else:
            layers.vocab(module, name, group, slicer, gather_logits)
    if sequence_parallel:
        for name, module in modules.items():
            if isinstance(module, nn.Embedding) and name not in styles:
                layers.sequence_split(module, group)
    layout.embeddings = frozenset(n for n in styles if isinstance(modules[n], nn.Embedding))
    layout.tiled = frozenset(n for n, m in modules.items() if isinstance(m, (TiledLinear, TiledEmbedding)))
    slicer.retie(model)
    for owner, patched in layout.patched.items():
        patch(modules[owner], patched)
    record(model, layout)
    return model


def tiled_styles(model: nn.Module, styles: dict[str, tuple[str, int]], gather_logits: bool,
                 sequence_parallel: bool) -> dict[str, tuple[str, int]]:
    """``styles`` with each layer ``zf.tile`` split along its rows (an LM head's vocabulary and an embedding
    tied to it: ``TiledLinear`` / ``TiledEmbedding``, ``dim=0``) styled per tile: each tile is a
    vocab-parallel layer of its own (its rows padded to a multiple of tp and sliced), so the tiled layer,
    which concatenates its tiles' outputs (the head's gathered logits) or looks each id up in its tile,
    computes the whole layer's output, and each tile's whole param is the tile of the model untiled by tp
    (checkpoints read into any tp). Other tiled layers cannot be sliced: ValueError naming the module."""
    modules = dict(model.named_modules())
    out = {}
    for name, (style, parts) in styles.items():
        module = modules[name]
        if not isinstance(module, (TiledLinear, TiledEmbedding)):
            out[name] = (style, parts)
            continue
        if style != "vocab" or module.dim != 0:
            raise ValueError(f"tensor_parallel: module '{name}' is tiled by zf.tile (dim={module.dim}) and its style "
                             f"is \"{style}\"; expected a vocab layer tiled along its rows (dim=0), each tile of "
                             "which is sliced as a vocabulary of its own, or \"replicate\"")
        if isinstance(module, TiledLinear) and not gather_logits:
            raise ValueError(f"gather_logits: the tiled head '{name}' concatenates its tiles' logits, which must be "
                             "gathered (each tile's vocab slice is not the head's); expected gather_logits=True")
        if isinstance(module, TiledEmbedding) and sequence_parallel:
            raise ValueError(f"sequence_parallel: the tiled embedding '{name}' looks each tile's ids up apart from the "
                             "others', not by token position, so its output cannot be cut into the ranks' tokens; "
                             "expected an untiled embedding (tile the head alone: untie it) with sequence_parallel")
        out.update({f"{name}.tiles.{i}": ("vocab", 1) for i in range(len(module.tiles))})
    return out


def _widths(modules: dict[str, nn.Module], styles: dict[str, tuple[str, int]], owner: str) -> dict[str, int]:
    """The output widths of ``owner``'s own colwise projections of one part (a q, k or v)."""
    out = {}
    for name, (style, parts) in styles.items():
        kind = layers.matmul_kind(modules[name])
        if style == "colwise" and parts == 1 and name.rpartition(".")[0] == owner and kind is not None:
            out[name] = modules[name].weight.shape[0 if kind == "linear" else 1]
    return out
