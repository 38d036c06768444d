"""Sequence parallelism: the layouts, Ulysses and ring attention against torch's attention, and the law --
an sp=2 step (grads reduced over dp x sp) trains as the plain step on the whole sequences."""
import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from zfunc.sequence import SequenceLayout

from models import hf_model  # noqa: E402  (tests/ is on the path)

STEPS = 5


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_the_ranks_of_a_layout_cover_the_sequence_once(kind, sp):
    T = 16
    index = torch.cat([SequenceLayout(sp, r, kind).index(T) for r in range(sp)])
    assert sorted(index.tolist()) == list(range(T))
    x = torch.arange(T)[None]
    assert all(torch.equal(SequenceLayout(sp, r, kind).take(x)[0], SequenceLayout(sp, r, kind).index(T))
               for r in range(sp))
    with pytest.raises(ValueError, match="length 10 does not split into"):
        SequenceLayout(4, 0, kind).index(10)


def test_the_loss_of_one_rank_holding_everything_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 8, 5, generator=g), torch.randint(0, 5, (2, 8), generator=g)
    labels[0, :3] = -100
    torch.testing.assert_close(zf.sequence.cross_entropy(logits, labels),
                               F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    hidden, weight = torch.randn(2, 8, 4, generator=g), torch.randn(5, 4, generator=g)
    torch.testing.assert_close(zf.sequence.lm_head_loss(hidden, weight, labels, tiles=3),
                               F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten()))


def _attention_case(rank, kind, H, H_kv, causal):
    """This rank's output and grads of sequence-parallel attention against torch's over the whole sequence."""
    mesh = zf.Mesh(sp=2)
    layout = SequenceLayout(2, mesh.sp_rank, zf.sequence.KINDS[kind])
    g = torch.Generator().manual_seed(H * 10 + H_kv)
    B, T, D = 2, 8, 4
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64).float().requires_grad_()
               for h in (H, H_kv, H_kv))
    dout = torch.randn(B, H, T, D, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H_kv != H)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    mine = [layout.take(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    if kind == "ulysses":
        out = zf.sequence.ulysses_attention(*mine, mesh.sp_comm, 2, sdpa=F.scaled_dot_product_attention,
                                            is_causal=causal, enable_gqa=H_kv != H)
    else:
        out = zf.sequence.ring_attention(*mine, mesh.sp_p2p, layout, is_causal=causal)
    grads = torch.autograd.grad(out, mine, layout.take(dout, dim=2))
    # each rank's grads of k and v are the whole sequence's grads of its own tokens
    return [(out - layout.take(ref, dim=2)).abs().max().item()] + [
        (gr - layout.take(r, dim=2)).abs().max().item() for gr, r in zip(grads, ref_grads)]


ATTENTION = [("ulysses", 4, 4, True), ("ulysses", 4, 2, True), ("ulysses", 2, 1, False),
             ("ring", 4, 4, True), ("ring", 3, 3, True), ("ring", 4, 2, True), ("ring", 3, 1, False)]


def test_ulysses_refuses_heads_sp_does_not_divide_naming_ring():
    q = torch.randn(1, 3, 4, 2)
    with pytest.raises(ValueError, match="3 attention heads over sp=2.*kind='ring'"):
        zf.sequence.ulysses_attention(q, q, q, zf.Mesh.alone().sp_comm, 2, sdpa=F.scaled_dot_product_attention)


# ------------------------------------------------------------------------------------------- the law


def _model(name):
    torch.manual_seed(0)
    if name == "gpt":
        from recipes.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if name == "llama":
        from recipes.llama import Llama, LlamaConfig
        return Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                 max_seq_len=16))
    if name == "llama-3-heads":  # heads sp=2 does not divide: ring only
        from recipes.llama import Llama, LlamaConfig
        return Llama(LlamaConfig(vocab_size=61, dim=24, n_layers=2, n_heads=3, n_kv_heads=3, ffn_dim=48,
                                 max_seq_len=16))
    model, _ = hf_model("llama")  # GQA: 2 heads, 1 key/value head
    model.config._attn_implementation = "sdpa"
    return model


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _blocks(model):
    return model.blocks if hasattr(model, "blocks") else model.model.layers if hasattr(model, "model") else model.layers


def _train(name, mesh=None, kind=None, stage=0, data=(), remat=False):
    """Losses, grad norms and params after training ``name`` on ``data``: plain (no mesh), or sequence-parallel
    over ``mesh`` with ZeRO ``stage`` over its dp x sp ranks, each dp rank given its part of the batch
    (``remat``: every block rematerialized)."""
    model = _model(name)
    layout = None
    if remat:
        for block in _blocks(model):
            block.forward = zf.remat(block.forward)
    if mesh is not None:
        zf.sequence_parallel(model, mesh, kind)
        layout = zf.sequence.layout_of(model)
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return zf.sequence.cross_entropy(_logits(apply(p, x)), y, layout)

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3, weight_decay=0.1))
    step = zf.train_step(loss_fn, opt)
    if mesh is not None:
        units = zf.units.by_class(type(_blocks(model)[0])) if stage == 3 else None
        step = zf.shard(step, mesh.dp_sp, stage, units=units)
    state = step.init(params)
    losses, norms = [], []
    dp, rank = (mesh.dp, mesh.rank) if mesh is not None else (1, 0)
    for x, y in data:
        b = x.shape[0] // dp
        state, m = step(state, (x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return losses, norms, zf.checkpoint.full_params(state)


def _data(b=4, T=16, vocab=61):
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        x = torch.randint(0, vocab, (b, T), generator=g)
        y = torch.roll(x, -1, 1)
        y[:, -1] = -100  # pre-shifted labels: the last token has none
        # fewer labels in the first half of some sequences (sp rank 0's tokens), alike in each dp rank's half
        # of the batch: dp averages the ranks' means, as zf.shard does, sp weighs each rank by its labels
        y[:: b // 2, : T // 2] = -100
        data.append((x, y))
    return data


def law_worker(rank, cases, dp, attention=()):
    mesh = zf.Mesh(dp=dp, sp=2)
    out = []
    for name, kind, stage, *remat in cases:
        got = _train(name, mesh, kind, stage, _data(), remat=bool(remat))
        ref = _train(name, data=_data())
        out.append((got, ref))
    return out, [_attention_case(rank, *case) for case in attention]


def _assert_law(results, cases):
    from models import assert_same_training

    for rank, (pairs, _) in enumerate(results):
        for case, (got, ref) in zip(cases, pairs):
            assert_same_training(got, ref, f"rank {rank}, {case}")


LAW = [("gpt", "ulysses", 0), ("llama", "ulysses", 0), ("hf-llama", "ulysses", 0),
       ("gpt", "ring", 0), ("llama", "ring", 0), ("hf-llama", "ring", 0), ("llama-3-heads", "ring", 0)]


@pytest.mark.multiprocess
def test_sp2_ulysses_and_ring_attention_and_training_equal_the_plain_ones():
    """One spawn (its start costs more than the cases): attention's output and grads against torch's over the
    whole sequence (GQA, heads sp does not divide: ring), then 5 steps of each model against the plain step."""
    pytest.importorskip("transformers")
    results = zf.dist.spawn(law_worker, 2, LAW, 1, ATTENTION, timeout_s=300)
    for rank, (_, errors) in enumerate(results):
        for case, err in zip(ATTENTION, errors):
            assert max(err) < 1e-5, f"rank {rank}, {case}: max errors (out, dq, dk, dv) {err}"
    _assert_law(results, LAW)


DP_SP = [("llama", "ulysses", 3), ("gpt", "ring", 3, "remat"), ("llama", "ulysses", 2, "remat")]


@pytest.mark.multiprocess
def test_zero_over_dp2_x_sp2_with_remat_trains_as_the_plain_step():
    _assert_law(zf.dist.spawn(law_worker, 4, DP_SP, 2, timeout_s=300), DP_SP)


def test_what_sequence_parallel_cannot_do_is_refused():
    from models import Tiny

    mesh = zf.Mesh.alone()
    with pytest.raises(ValueError, match="Tiny.forward takes no position_ids"):
        zf.sequence_parallel(Tiny(), mesh)
    with pytest.raises(ValueError, match="kind: expected one of"):
        zf.sequence_parallel(_model("gpt"), mesh, kind="striped")
    model = zf.sequence_parallel(_model("gpt"), mesh)
    with pytest.raises(ValueError, match="already sequence-parallel"):
        zf.sequence_parallel(model, mesh)
    with pytest.raises(ValueError, match="position_ids, attention_mask"):
        model(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="Tiny is not sequence-parallel"):
        zf.sequence.layout_of(Tiny())
    x = torch.randint(0, 61, (2, 8))  # one rank holding everything: the model unchanged
    torch.testing.assert_close(model(x), _model("gpt")(x))
    assert torch.nn.functional.scaled_dot_product_attention is zf.sequence.parallel._TORCH_SDPA
