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


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward while it is entered, each saved tensor once (a view by
    its own elements: q, k and v split from one exchanged tensor count as their parts)."""

    def __init__(self):
        self.bytes, self._seen = 0, set()

        def pack(t):
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.numel() * t.element_size()
            return t

        super().__init__(pack, lambda t: t)


def _attention_case(rank, kind, H, H_kv, causal, mesh):
    """This rank's output and grads of sequence-parallel attention against torch's over the whole sequence;
    the bytes it moved and the activations it kept against the kind's formulas."""
    layout = SequenceLayout(2, mesh.sp_rank, zf.sequence.KINDS[kind])
    g = torch.Generator().manual_seed(H * 10 + H_kv)
    B, T, D = 2, 12, 4
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64).float().requires_grad_()
               for h in (H, H_kv, H_kv))
    dout = torch.randn(B, H, T, D, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H_kv != H)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    mine = [layout.take(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    saved = _SavedBytes()
    with saved:
        if kind == "ulysses":
            out = zf.sequence.ulysses_attention(*mine, mesh.sp_comm, 2, sdpa=F.scaled_dot_product_attention,
                                                is_causal=causal, enable_gqa=H_kv != H)
        else:
            out = zf.sequence.ring_attention(*mine, mesh.sp_p2p, layout, is_causal=causal, tile=2)  # uneven tiles
    # the activations one call keeps for backward, as the kind's docstring counts them
    if kind == "ulysses":
        kept = zf.sequence.ulysses.activation_bytes(B, T // 2, H, H_kv, D, 4, 2)
    else:
        kept = zf.sequence.ring.activation_bytes(B, T // 2, H, H_kv, D, 4)
    assert saved.bytes == kept, (kind, H, H_kv, causal, saved.bytes, kept)
    grads = torch.autograd.grad(out, mine, layout.take(dout, dim=2))
    # the bytes one call moves, forward and backward, as the kind's docstring counts them
    if kind == "ulysses":
        moved, formula = mesh.sp_comm.bytes["all_to_all"], zf.sequence.ulysses.comm_bytes(B, T // 2, H, H_kv, D, 4, 2)
    else:
        moved, formula = mesh.sp_p2p.bytes["send"], zf.sequence.ring.comm_bytes(B, T // 2, H_kv, D, 4, 2)
        assert mesh.sp_p2p.bytes["recv"] == moved
    assert moved == formula, (kind, moved, formula)
    mesh.clear_comm_bytes()
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
    if name == "gpt-4-heads":  # tp=2 leaves 2 heads a rank: Ulysses over sp=2 splits them
        from recipes.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32))
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


def _prepared(name, remat=False, tiles=0):
    """``name``'s model: ``remat``, every block rematerialized; ``tiles``, every MLP over that many token
    tiles and the head computing the loss over as many (ALST's tiled MLP and loss)."""
    model = _model(name)
    for block in _blocks(model):
        if tiles:
            zf.tiling.tile_tokens(block.mlp, tiles=tiles)
        if remat:
            block.forward = zf.remat(block.forward)
    if tiles:
        zf.sequence.loss_head(model, tiles=tiles)
    return model


def _loss_of(apply, layout, tiles):
    def loss_fn(p, batch):
        x, y = batch
        if tiles:
            with zf.sequence.targets(y, layout):
                return _logits(apply(p, x))
        return zf.sequence.cross_entropy(_logits(apply(p, x)), y, layout)

    return loss_fn


def _opt():
    return zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3, weight_decay=0.1))


def _train(name, mesh=None, kind=None, stage=0, data=(), remat=False, tiles=0, save=None, offload=False):
    """Losses, grad norms and params after training ``name`` on ``data``: plain (no mesh, untiled), or
    sequence-parallel over ``mesh`` with ZeRO ``stage`` over its dp x sp ranks, each dp rank given its part
    of the batch (``remat``, ``tiles``: see ``_prepared``; ``offload``: the optimizer state in CPU RAM)."""
    model = _prepared(name, remat, tiles)
    layout = None
    if mesh is not None:
        zf.sequence_parallel(model, mesh, kind)
        layout = zf.sequence.layout_of(model)
    apply, params = zf.functionalize(model)
    loss_fn = _loss_of(apply, layout, tiles)

    step = zf.train_step(loss_fn, _opt())
    if mesh is not None:
        units = zf.units.by_class(type(_blocks(model)[0])) if stage == 3 else None
        step = zf.shard(step, mesh, stage, units=units)  # a mesh with sp: ZeRO over its dp x sp ranks
        if offload:
            step = zf.offload(step, "cpu")
    state = step.init(params)
    losses, norms = [], []
    dp, rank = (mesh.dp, mesh.rank) if mesh is not None else (1, 0)
    for x, y in data:
        b = x.shape[0] // dp
        state, m = step(state, (x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    if save is not None:
        zf.checkpoint.save(state, save)
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


def law_worker(rank, cases, dp, attention=(), save=None):
    """Per case (got, ref, sp bytes moved per step), and the attention cases' errors."""
    mesh = zf.Mesh(dp=dp, sp=2)
    out = []
    mesh.clear_comm_bytes()
    attention_errors = [_attention_case(rank, *case, mesh) for case in attention]
    for name, kind, stage, *how in cases:
        got = _train(name, mesh, kind, stage, _data(), remat="remat" in how, tiles=2 * ("tiles" in how),
                     save=f"{save}/{len(out)}" if save else None, offload="offload" in how)
        moved = {k: v / STEPS for k, v in (mesh.sp_comm.bytes | mesh.sp_p2p.bytes).items() if v}
        mesh.clear_comm_bytes()
        ref = _train(name, data=_data())
        out.append((got, ref, moved))
    return out, attention_errors


def _assert_law(results, cases):
    from models import assert_same_training

    for rank, (pairs, _) in enumerate(results):
        for case, (got, ref, *_) in zip(cases, pairs):
            assert_same_training(got, ref, f"rank {rank}, {case}")


def _assert_plan_counts_the_bytes(results, cases, dp, **axes):
    """zfunc.plan's sequence-parallel bytes per step (``cost.sequence_bytes``, from the model's shape and the
    plan: ``dp`` and ``axes``, e.g. tp, pp and microbatches) equal what rank 0's sp communicators counted."""
    from zfunc import plan as zp
    from zfunc.plan.cost import sequence_bytes

    for case, (_, _, moved, *_) in zip(cases, results[0][0]):
        name, kind, stage, *how = case
        x, _ = _data()[0]
        spec = zp.from_module(_model(name))
        s = zf.config.Plan(dp=dp, sp_size=2, sp_kind=kind, zero_stage=stage, precision="fp32", remat="remat" in how,
                           micro_batch=x.shape[0] // dp // axes.get("microbatches", 1), seq=x.shape[1], **axes)
        assert moved == sequence_bytes(spec, s), (case, moved, sequence_bytes(spec, s))


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
    _assert_plan_counts_the_bytes(results, LAW, 1)


DP_SP = [("llama", "ulysses", 3), ("gpt", "ring", 3, "remat"), ("llama", "ulysses", 2, "remat", "tiles"),
         ("hf-llama", "ring", 3, "remat", "tiles"), ("llama", "ring", 2, "offload")]


@pytest.mark.multiprocess
def test_zero_over_dp2_x_sp2_with_remat_trains_as_the_plain_step_and_saves_a_plain_checkpoint(tmp_path):
    """The law over dp2 x sp2 (with CPU offload too), and sp leaves checkpoints alone: each state saved from 4
    ranks loads into a one-process plain step with the params the sequence-parallel run trained."""
    results = zf.dist.spawn(law_worker, 4, DP_SP, 2, (), str(tmp_path), timeout_s=300)
    _assert_law(results, DP_SP)
    _assert_plan_counts_the_bytes(results, DP_SP, 2)
    for i, (name, kind, stage, *how) in enumerate(DP_SP):
        apply, params = zf.functionalize(_prepared(name, "remat" in how, 2 * ("tiles" in how)))
        plain = zf.train_step(_loss_of(apply, None, 0), _opt())
        loaded = zf.checkpoint.load(str(tmp_path / str(i)), plain)
        trained = results[0][0][i][0][2]
        for leaf, value in loaded.params.items():
            torch.testing.assert_close(value, trained[leaf], rtol=0, atol=0, msg=f"{name}, {kind}: {leaf}")


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
    sp_mesh = zf.Mesh.alone()  # reads as pp=2, sp=2: a pipeline of a step nothing reduces over sp
    sp_mesh.pp, sp_mesh.sp = 2, 2
    apply, params = zf.functionalize(model)
    with pytest.raises(ValueError, match=r"mesh: sp=2; the sequence ranks' grads are reduced by zf.shard"):
        zf.pipeline(zf.train_step(lambda p, b: apply(p, b).sum(), _opt()), 2, 2, model=model, mesh=sp_mesh,
                    units=zf.units.by_class(type(model.blocks[0])))


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_tiled_mlp_and_tiled_loss_equal_the_untiled_ones(name, remat):
    x, y = _data()[0]
    grads = []
    for tiles in (0, 3):
        apply, params = zf.functionalize(_prepared(name, remat, tiles))
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        loss = _loss_of(apply, None, tiles)(leaves, (x, y))
        grads.append((loss, torch.autograd.grad(loss, list(leaves.values()))))
    (loss, ref), (tiled_loss, tiled) = grads
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(tiled, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_a_tiled_mlp_holds_one_tile_of_its_intermediate():
    from zfunc.model.tiling import WorkingMemory

    d, T = 16, 512
    mlp = torch.nn.Sequential(torch.nn.Linear(d, 8 * d), torch.nn.GELU(), torch.nn.Linear(8 * d, d))
    x = torch.randn(1, T, d, requires_grad=True)
    peaks = []
    for tiles in (1, 8):
        if tiles > 1:
            zf.tiling.tile_tokens(mlp, tiles=tiles)
        with WorkingMemory() as mem:
            mlp(x).sum().backward()
        peaks.append(mem.peak_bytes)
    whole = T * 8 * d * 4  # one (T, 8d) fp32 intermediate
    assert peaks[0] > 2 * whole and peaks[1] < whole, peaks



def layout_worker(rank, cases):
    """sp2 with tp2 or pp2 on 4 ranks through the front door (``zf.config.prepare``: the model sliced over tp, its
    plan found from the module graph, blocks rematerialized; ``zf.parallelize``: the tp step or the pipeline over
    ZeRO across each tp slice's or stage's sp ranks, the model sequence-parallel): per case (losses, norms, whole
    params), the plain step's, the sp bytes per step and the step's layers; and the refusal of Ulysses where a tp
    rank's heads do not split over sp."""
    meshes = {"sp2 x tp2": zf.Mesh(dp=1, sp=2, tp=2), "pp2 x sp2": zf.Mesh(dp=1, pp=2, sp=2)}
    out = []
    for axes, name, kind, stage, *how in cases:
        mesh, model = meshes[axes], _model(name)
        plan = zf.config.Plan(pp=mesh.pp, microbatches=2 if mesh.pp > 1 else 1, sp_size=2, sp_kind=kind, tp=mesh.tp,
                              zero_stage=stage, remat="remat" in how, precision="fp32", units="class:Block")
        zf.config.prepare(model, plan, mesh)
        apply, params = zf.functionalize(model)

        def loss_fn(p, batch, model=model, apply=apply):
            return zf.sequence.cross_entropy(_logits(apply(p, batch[0])), batch[1], zf.sequence.layout_in_force(model))

        step = zf.parallelize(zf.train_step(loss_fn, _opt()), model, plan, mesh)
        state, losses, norms = step.init(params), [], []
        mesh.clear_comm_bytes()
        for batch in _data():
            state, m = step(state, batch)
            losses.append(m["loss"].item())
            norms.append(m["grad_norm"].item())
        moved = {k: v / STEPS for k, v in (mesh.sp_comm.bytes | mesh.sp_p2p.bytes).items() if v}
        got = (losses, norms, zf.checkpoint.full_params(state, mesh))
        out.append((got, _train(name, data=_data()), moved, step.layers))
    model = zf.tensor_parallel(_model("gpt"), meshes["sp2 x tp2"])  # 2 heads: 1 a tp rank
    zf.sequence_parallel(model, meshes["sp2 x tp2"], "ulysses")
    try:
        model(_data()[0][0])
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return out, refusal


SP_TP = [("gpt-4-heads", "ulysses", 0), ("llama", "ulysses", 2, "remat"), ("gpt", "ring", 3), ("llama", "ring", 1)]
PP_SP = [("llama", "ulysses", 3, "remat"), ("gpt", "ring", 1, "remat")]


@pytest.mark.multiprocess
def test_sp2_with_tp2_or_under_a_pipeline_of_2_stages_on_4_ranks_trains_as_the_plain_step():
    """sp2 x tp2: Ulysses over each tp slice's heads (GQA: a tp rank's one kv head repeated), ring where they do
    not split (GPT's 2 heads over tp=2), ZeRO 0-3 over the sp ranks of each tp slice, remat; zf.plan's sp bytes
    per step (a tp rank's heads) equal the ranks' counts. pp2 x sp2 (1F1B, 2 microbatches, each microbatch
    alike in valid labels, so their mean is the batch's): ZeRO 1/3 over each stage's sp ranks, every block
    rematerialized (recomputed in a stage's backward with the sequence-parallel attention)."""
    cases = [("sp2 x tp2", *c) for c in SP_TP] + [("pp2 x sp2", *c) for c in PP_SP]
    everyone = zf.dist.spawn(layout_worker, 4, cases, timeout_s=300)
    _assert_law(everyone, cases)
    layers = [c[-1] for c in everyone[0][0]]
    assert layers == [("train_step", "tensor_parallel", "shard")] * len(SP_TP) + [
        ("train_step", "shard", "pipeline")] * len(PP_SP)
    pairs = everyone[0][0]
    _assert_plan_counts_the_bytes([(pairs[:len(SP_TP)], None)], SP_TP, 1, tp=2)
    _assert_plan_counts_the_bytes([(pairs[len(SP_TP):], None)], PP_SP, 1, pp=2, microbatches=2)
    for _, refusal in everyone:
        assert "the 1 attention heads this rank holds of the model's 2 over tp=2" in refusal, refusal
        assert "kind='ring'" in refusal
