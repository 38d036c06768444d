"""tile: tiled layers, functions and the LM head loss equal the untiled op, in less working memory."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.models import token_loss, untile
from zfunc.checkpoint import full_params


def assert_rel(actual, expected, rtol=1e-6, what=""):
    """max |a - e| <= rtol * max |e|: fp32 relative error 1e-6 of the tensor. Elementwise rtol would
    fail on the entries a reordered sum cancels to near zero, whatever the rounding."""
    scale = expected.abs().max().item() or 1.0
    err = (actual - expected).abs().max().item() / scale
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol}"


def grads_of(fn, *inputs):
    out = fn(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))  # not _like: strides differ
    return out, torch.autograd.grad(out, inputs, cot)


# ------------------------------------------------------------------------------------ layers


@pytest.mark.parametrize("dim", [0, 1])
def test_linear_tiled_over_out_or_in_features_equals_linear(dim):
    torch.manual_seed(0)
    lin = nn.Linear(12, 10)
    tiled = zf.tile(lin, tiles=3, dim=dim)  # 10 or 12 split unevenly / evenly: (4, 3, 3) or (4, 4, 4)
    assert [n for n, _ in tiled.named_parameters()][:2] == ["tiles.0.weight", "tiles.0.bias"]
    x = torch.randn(7, 5, 12, requires_grad=True)
    ref, (ref_x, ref_w, ref_b) = grads_of(lambda x, w, b: F.linear(x, w, b), x, lin.weight, lin.bias)
    tile_params = [p for t in tiled.tiles for p in (t.weight, t.bias) if p is not None]
    out, (gx, *gp) = grads_of(lambda x, *ps: tiled(x), x, *tile_params)
    assert_rel(out, ref, what="output")
    assert_rel(gx, ref_x, what="grad of x")
    assert_rel(torch.cat(gp[0::2] if dim == 0 else gp[:1] + gp[2:], dim), ref_w, what="grad of weight")
    assert_rel(torch.cat(gp[1::2]) if dim == 0 else gp[1], ref_b, what="grad of bias")


@pytest.mark.parametrize("dim", [0, 1])
def test_embedding_tiled_over_rows_or_columns_equals_embedding(dim):
    torch.manual_seed(0)
    emb = nn.Embedding(11, 8, padding_idx=3, scale_grad_by_freq=True)
    tiled = zf.tile(emb, tiles=4, dim=dim)
    idx = torch.randint(0, 11, (6, 9))
    idx[0, :3] = torch.tensor([3, 10, 10])  # the padding row and a repeated index
    ref, (ref_w,) = grads_of(lambda w: F.embedding(idx, w, 3, scale_grad_by_freq=True), emb.weight)
    out, gw = grads_of(lambda *ws: tiled(idx), *[t.weight for t in tiled.tiles])
    assert_rel(out, ref, what="output")
    assert_rel(torch.cat(gw, dim), ref_w, what="grad of weight")
    assert torch.cat(gw, dim)[3].abs().sum() == 0  # padding_idx gets no grad


def test_tied_head_is_refused_alone_and_tiled_consistently_through_the_model():
    torch.manual_seed(0)
    model = TinyGPT()
    with pytest.raises(ValueError, match="module: its weight is also held by Embedding.*modules=\\['lm_head'\\]"):
        zf.tile(model.lm_head, tiles=4)
    ref = copy.deepcopy(model)
    assert zf.tile(model, tiles=4, modules=["lm_head"]) is model  # in place
    assert all(h.weight is e.weight for h, e in zip(model.lm_head.tiles, model.wte.tiles))
    idx = torch.randint(0, 32, (3, 7))
    assert_rel(model(idx), ref(idx), what="tied model output")
    both = zf.tile(TinyGPT(), tiles=4, modules=["wte", "lm_head"])  # the tie of the first is the second
    assert both.lm_head.tiles[0].weight is both.wte.tiles[0].weight
    untied = TinyGPT(tie=False)
    assert isinstance(zf.tile(untied.lm_head, tiles=4), zf.tiling.TiledLinear)  # nothing else holds it


# ------------------------------------------------------------------------------------ LM head + loss


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lm_head_loss_equals_cross_entropy_with_uneven_tiles_and_ignored_targets(reduction):
    torch.manual_seed(0)
    hidden = torch.randn(3, 13, 16, requires_grad=True)  # 39 tokens in 4 tiles: 10, 10, 10, 9
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 13))
    targets.view(-1)[10:20] = -100  # a whole tile ignored
    targets.view(-1)[33] = -100

    def untiled(h, w):
        return F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten(), reduction=reduction)

    ref, ref_grads = grads_of(untiled, hidden, weight)
    out, grads = grads_of(lambda h, w: zf.tiling.lm_head_loss(h, w, targets, tiles=4, reduction=reduction),
                          hidden, weight)
    assert_rel(out, ref, what="loss")
    for g, r, what in zip(grads, ref_grads, ("hidden", "weight")):
        assert_rel(g, r, what=f"grad of {what}")
    with torch.no_grad():  # no grads wanted: only the loss is computed
        assert_rel(zf.tiling.lm_head_loss(hidden, weight, targets, tiles=4, reduction=reduction), ref)


def test_lm_head_loss_edge_cases_match_torch():
    torch.manual_seed(0)
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    ignored = torch.full((6,), -100)
    loss = zf.tiling.lm_head_loss(h, w, ignored, tiles=6)  # every target ignored: nan, zero grads
    loss.backward()
    assert loss.isnan() and F.cross_entropy(h @ w.T, ignored).isnan()
    assert h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0
    y = torch.randint(0, 9, (6,))  # torch.func.grad goes through the setup_context Function
    g = torch.func.grad(lambda w: zf.tiling.lm_head_loss(h.detach(), w, y, tiles=4))(w.detach())
    assert_rel(g, torch.func.grad(lambda w: F.cross_entropy(h.detach() @ w.T, y))(w.detach()))


# ------------------------------------------------------------------------------------ function form


def test_function_form_concatenates_or_reduces_like_the_untiled_function():
    torch.manual_seed(0)
    x, t = torch.randn(23, 8, requires_grad=True), torch.randn(23, 8)
    w = torch.randn(8, 32, requires_grad=True)

    def mlp(x):
        return F.gelu(x @ w) @ w.T

    def loss(x, t, scale=1.0):
        return ((mlp(x) - t) ** 2).mean() * scale

    cases = [(mlp, {"tiles": 5}, (x,)), (loss, {"tiles": 5, "reduce": "mean", "argnums": (0, 1)}, (x, t)),
             (lambda x: mlp(x).sum(), {"tiles": 4, "reduce": "sum"}, (x,)),
             (lambda xt: mlp(xt.T).T, {"tiles": 3, "dim": 1}, (x.T.detach().requires_grad_(),))]
    for fn, kw, args in cases:
        tiled = zf.tile(fn, **kw)
        ref, ref_grads = grads_of(lambda x, w, fn=fn, rest=args[1:]: fn(x, *rest), args[0], w)
        out, grads = grads_of(lambda x, w, fn=tiled, rest=args[1:]: fn(x, *rest), args[0], w)
        assert_rel(out, ref, what=f"{kw} output")
        for g, r in zip(grads, ref_grads):
            assert_rel(g, r, what=f"{kw} grads")
    tiled = zf.tile(loss, tiles=2, reduce="mean", argnums=(0, 1))
    assert_rel(tiled(x, t, scale=3.0), loss(x, t, scale=3.0), what="kwargs")


# ------------------------------------------------------------------------------------ accounting


def working_bytes(fn, *inputs):
    with zf.tiling.WorkingMemory() as mem:
        fn(*inputs).backward()
    return mem.peak_bytes


def test_accounted_working_memory_is_a_kth_of_untiled_plus_one_tile():
    torch.manual_seed(0)
    k, n, d, vocab = 4, 512, 16, 2000
    hidden, weight = torch.randn(n, d, requires_grad=True), torch.randn(vocab, d, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    untiled = working_bytes(lambda h, w: F.cross_entropy(h @ w.T, targets), hidden, weight)
    tiled = working_bytes(lambda h, w: zf.tiling.lm_head_loss(h, w, targets, tiles=k), hidden, weight)
    logits_tile = n // k * vocab * 4
    assert untiled >= 3 * n * vocab * 4  # logits, log-softmax and their grad
    assert tiled <= untiled / k + logits_tile and tiled < n * vocab * 4  # never the whole logits
    w1, w2 = torch.randn(d, 256, requires_grad=True), torch.randn(256, d, requires_grad=True)

    def mlp_loss(x):
        return (F.gelu(x @ w1) @ w2).pow(2).mean()

    untiled = working_bytes(mlp_loss, hidden)
    tiled = working_bytes(zf.tile(mlp_loss, tiles=k, reduce="mean"), hidden)
    assert tiled <= untiled / k + n // k * 256 * 4, (tiled, untiled)


# ------------------------------------------------------------------------------------ stage 3


class TinyGPT(nn.Module):
    """Embedding tied to the head (vocab 32 = 4 tiles of 8), two residual Linear blocks."""

    def __init__(self, vocab=32, d=8, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.lm_head(self.ln_f(x))


def gpt_run(config, mesh=None, rank=0, world=1, steps=3):
    """Losses, whole params and peak gathered bytes of 3 AdamW steps; ``config`` picks the model:
    ``"plain"`` / ``"plain-tied"`` untiled, ``"tiled"`` (untied, wte and lm_head in 4 tiles each),
    ``"tiled-tied"`` (the head tiled through the model, its tie kept)."""
    torch.manual_seed(0)
    model = TinyGPT(tie=config.endswith("tied"))
    if config.startswith("tiled"):
        zf.tile(model, tiles=4, modules=["lm_head"] if config == "tiled-tied" else ["wte", "lm_head"])
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply), zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-2)))
    if mesh is not None:
        step = zf.shard(step, mesh, 3, units=zf.units.by_class(nn.Linear))
    state, g, losses, peaks = step.init(params), torch.Generator().manual_seed(1), [], []
    for _ in range(steps):
        x, y = torch.randint(0, 32, (2, 2 * world, 6), generator=g)
        mine = slice(rank * 2, (rank + 1) * 2) if mesh is not None else slice(None)  # plain: the whole batch
        state, m = step(state, (x[mine], y[mine]))
        losses.append(m["loss"].item())
        peaks.append(getattr(step, "peak_gathered_bytes", 0))
    return losses, (full_params(state, mesh) if mesh is not None else state.params), max(peaks)


CONFIGS = ("plain", "tiled", "tiled-tied")


def stage3_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    return {config: gpt_run(config, mesh, rank, world) for config in CONFIGS}


@pytest.mark.multiprocess
def test_tiled_head_under_stage_3_trains_like_the_plain_untiled_model_and_is_never_whole():
    world = 2
    refs = {tie: gpt_run("plain" + tie, world=world) for tie in ("", "-tied")}
    head_bytes, block_bytes = 32 * 8 * 4, (8 * 8 + 8) * 4
    for rank, result in enumerate(zf.dist.spawn(stage3_worker, world, world)):
        for config, (losses, params, peak) in result.items():
            what = f"{config}, rank {rank}"
            ref_losses, ref_params, _ = refs["-tied" if config.endswith("tied") else ""]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=what)
            params = untile(params)
            assert params.keys() == ref_params.keys()
            for name in ref_params:
                torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")
        peaks = {config: r[2] for config, r in result.items()}
        # untiled, the head is one unit gathered whole; tiled, at most two small units are whole at
        # once (prefetch 1): a head or embedding tile (256 B) or a block's Linear (288 B)
        assert peaks["plain"] >= head_bytes
        assert peaks["tiled"] <= 2 * block_bytes < head_bytes
        # tied: stage 3 keeps a tied unit gathered from the head's backward until the embedding's
        # grad completes it (prefetch.py), so all head tiles are whole together in backward
        assert peaks["tiled-tied"] <= head_bytes + 2 * block_bytes + 16 * 4


# ------------------------------------------------------------------------------------ bad input


def test_bad_input_is_reported_clearly():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    cases = [
        (lambda: zf.tile(lin, tiles=0), ValueError, "tiles: expected an int >= 1, got 0"),
        (lambda: zf.tile(lin, tiles=True), ValueError, "tiles: expected an int >= 1"),
        (lambda: zf.tile(lin, tiles=4), ValueError,
         "tiles: 4 tiles but dim 0 of module's weight \\(3, 4\\) has only 3"),
        (lambda: zf.tile(lin, tiles=2, dim=2), ValueError, "dim: expected 0 \\(out features\\) or 1"),
        (lambda: zf.tile(nn.Conv1d(2, 2, 1), tiles=2), TypeError, "module: zf.tile tiles nn.Linear and nn.Embedding"),
        (lambda: zf.tile(nn.Embedding(4, 2, max_norm=1.0), tiles=2), ValueError, "max_norm"),
        (lambda: zf.tile(lin, tiles=2, reduce="sum"), ValueError, "reduce: only the function form"),
        (lambda: zf.tile(TinyGPT(), tiles=2, modules=["head"]), ValueError, "modules: 'head' is not a submodule"),
        (lambda: zf.tile(TinyGPT(), tiles=2, modules=["ln_f"]), TypeError,
         "modules\\['ln_f'\\]: zf.tile tiles nn.Linear"),
        (lambda: zf.tile(42, tiles=2), TypeError, "module_or_fn: expected"),
        (lambda: zf.tile(torch.sin, tiles=2, reduce="max"), ValueError, "reduce: expected None, 'sum' or 'mean'"),
        (lambda: zf.tile(torch.sin, tiles=2, modules=["x"]), ValueError, "modules: only a model"),
        (lambda: zf.tile(torch.sin, tiles=2, dim=2)(x), ValueError,
         "dim: 2 is out of range for argument 0 of shape \\(2, 4\\)"),
        (lambda: zf.tile(torch.sin, tiles=3)(x), ValueError, "tiles: 3 tiles but dim 0 of argument 0"),
        (lambda: zf.tile(torch.add, tiles=2, argnums=(0, 1))(x, x[:1]), ValueError,
         "argnums: argument 1 has 1 entries"),
        (lambda: zf.tile(torch.add, tiles=2, argnums=2)(x, x), ValueError, "argnums: argument 2 is not a tensor"),
        (lambda: zf.tiling.lm_head_loss(x, torch.randn(5, 3), torch.zeros(2, dtype=torch.long), tiles=2),
         ValueError, "weight: expected shape \\(vocab, 4\\)"),
        (lambda: zf.tiling.lm_head_loss(x, torch.randn(5, 4), torch.zeros(2), tiles=2),
         ValueError, "targets: expected integer"),
        (lambda: zf.tiling.lm_head_loss(x, torch.randn(5, 4), torch.zeros(2, dtype=torch.long), tiles=3),
         ValueError, "tiles: 3 tiles but hidden"),
        (lambda: zf.tiling.lm_head_loss(x, torch.randn(5, 4), torch.zeros(2, dtype=torch.long), tiles=2,
                                        reduction="none"),
         ValueError, "reduction: expected 'mean' or 'sum'"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_lm_head_loss_over_a_vocab_slice_names_what_is_wrong():
    hidden, weight, targets = torch.randn(2, 4, 8), torch.randn(5, 8), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_size: names the vocabulary of a vocab-sliced weight, with mesh="):
        zf.tiling.lm_head_loss(hidden, weight, targets, tiles=2, vocab_size=9)
    mesh = zf.Mesh.planned(tp=2)  # shapes only: the checks come before any collective
    with pytest.raises(ValueError, match=r"vocab_size: a weight slice of 5 rows on each of tp=2 ranks holds a "
                                         r"vocabulary of 6 to 10, got 11"):
        zf.tiling.lm_head_loss(hidden, weight, targets, tiles=2, mesh=mesh, vocab_size=11)
    with pytest.raises(zf.dist.CollectiveError, match="this mesh is planned"):
        zf.tiling.lm_head_loss(hidden, weight, targets, tiles=2, mesh=mesh, vocab_size=9)
