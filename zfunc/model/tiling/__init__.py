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
``TiledEmbedding``, ``materializer`` and ``tile_tokens`` (an MLP over sequence tiles,
``zfunc.model.token_tiles``) hang off it (``zf.tiling.lm_head_loss``) and import from ``zfunc.model.tiling``.

The package: ``zf.tile``'s entry point (entry.py), the layer forms and ``materializer`` (layers.py), the
function form (function.py), ``lm_head_loss`` (lm_head.py), ``WorkingMemory`` (working_memory.py) and how
k tiles cut a size (split.py).
"""

from zfunc.model.tiling.entry import tile
from zfunc.model.tiling.layers import TiledEmbedding, TiledLinear, materializer
from zfunc.model.tiling.lm_head import lm_head_loss
from zfunc.model.tiling.working_memory import WorkingMemory
from zfunc.model.token_tiles import tile_tokens

__all__ = ["TiledEmbedding", "TiledLinear", "WorkingMemory", "lm_head_loss", "materializer", "tile", "tile_tokens"]
