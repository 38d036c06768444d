"""The tiny models, data and training helpers the tests share (one place; no test file imports another).

- ``Tiny`` (built of ``Block``s; embedding tied to the head, uneven rows so shards pad), ``make``
  (its step, plain or sharded), ``batches``/``local`` (a global batch and one rank's share),
  ``train_on`` (step through batches: state, losses, grad norms) and ``assert_same_training``:
  the shape of most laws "this transformation trains as the plain step".
- Builders: ``token_loss`` (a token model's cross-entropy), ``adamw`` (the tests' optimizer),
  ``mesh_shaped`` (a one-process mesh that reads as any rank of any shape, for build-time
  refusals), ``make_offloaded``, ``recipe_step`` (the recipes' debug models, plain or ZeRO-3 with
  CPU offload) and ``fixtures_step`` (the DeepSpeed fixtures' model and optimizer).
- Faults: ``PoisonGrad`` (finite loss, inf grads), ``inject``, ``with_faults``; ``tree_equal``.
- BatchNorm: ``BNNet``, ``bn_batches``, ``bn_step``, ``torch_train`` (torch's own loop, the
  reference for carried buffers) and ``assert_trained_like``.
- Pipeline models: ``PipeTiny`` (4 blocks, tied ends; can be made to misbehave), ``pipe_batches``,
  ``NormStack``/``NormUnit``/``norm_step`` (pipeline units with BatchNorm).
- ``untile`` (tiled params back to whole ones), ``hf_model`` (our GPT and Hugging Face models).
"""
import copy
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf

STEPS = 5


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.ln(x)))


class Tiny(nn.Module):
    """Embedding tied to the head, uneven row counts (13, 6) so shards are padded."""

    def __init__(self, vocab=13, d=6, n=3, tie=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx, skip=None):
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = b(x)
        return self.head(self.ln_f(x))


def mesh_shaped(dp=1, pp=1, rank=0, pp_rank=0, tp=1, tp_rank=0):
    """A ``zf.Mesh`` of this process alone that reads as rank ``(rank, pp_rank, tp_rank)`` of ``dp x pp x tp``: for
    the checks a transformation makes when it is built, which read only the mesh's shape. Its
    collectives are copies (``zf.Mesh.alone``), so a step built on it is never run."""
    mesh = zf.Mesh.alone()
    mesh.dp, mesh.pp, mesh.rank, mesh.pp_rank, mesh.tp, mesh.tp_rank = dp, pp, rank, pp_rank, tp, tp_rank
    return mesh


def token_loss(apply):
    """``loss_fn(params, (x, y))``: the cross-entropy of ``apply(params, x)``'s logits against the tokens ``y``."""

    def loss_fn(p, batch):
        return F.cross_entropy(apply(p, batch[0]).flatten(0, 1), batch[1].flatten())

    return loss_fn


def adamw(clip=True, backend="auto"):
    """The tests' optimizer, a chain: AdamW (lr 1e-2, weight decay 0.1 off biases and norms), after
    clipping the global grad norm at 0.1 when ``clip``."""
    clipping = [zf.optim.clip_by_global_norm(0.1)] if clip else []
    return zf.optim.chain(*clipping, zf.optim.adamw(1e-2, weight_decay=0.1, mask=zf.optim.decay_mask, backend=backend))


def make(stage=None, mesh=None, accum=1, clip=True, model_kw=None, prefetch=1, vocab=13, bucket_mb=25.0,
         precision="fp32", grad_norm=True):
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny(vocab=vocab, **(model_kw or {})))

    def loss_fn(p, batch):
        x, y, *skip = batch
        return F.cross_entropy(apply(p, x, skip[0] if skip else None).flatten(0, 1), y.flatten())

    step = zf.train_step(loss_fn, adamw(clip), precision, accum=accum, grad_norm=grad_norm)
    if stage is not None:
        units = zf.units.by_class(Block) if stage == 3 else None
        step = zf.shard(step, mesh, stage, units=units, prefetch=prefetch if stage == 3 else 1, bucket_mb=bucket_mb)
    return step, step.init(params)


def batches(world, n=STEPS, b=4, vocab=13):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (world * b, 5), generator=g), torch.randint(0, vocab, (world * b, 5), generator=g))
            for _ in range(n)]


def local(batch, rank, world):
    b = batch[0].shape[0] // world
    return tuple(t[rank * b:(rank + 1) * b] for t in batch)


def train_on(step, state, batches, rank=0, shards=1):
    """Step through ``batches``, this process taking its share ``rank`` of ``shards`` of each
    (1: the whole batch, as a plain reference does): ``(state, losses, grad norms)``."""
    losses, norms = [], []
    for batch in batches:
        state, m = step(state, local(batch, rank, shards))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return state, losses, norms


def run(step, state, data, rank=0, world=1):
    """``state`` after stepping through ``data``, this process taking its share ``rank`` of ``world``."""
    for batch in data:
        state, _ = step(state, local(batch, rank, world))
    return state


def recipe_step(build, loss_of, unit, mesh=None, accum=1, weight_decay=0.1):
    """``(step, state)`` of the model ``build()`` makes (seed 0) with the loss ``loss_of(apply)``: AdamW
    3e-3 (``weight_decay`` off biases and norms) after clipping at 1.0; on ``mesh``, ZeRO-3 (a unit per
    ``unit`` module) with the optimizer state in CPU RAM. The recipes' debug models train on it."""
    torch.manual_seed(0)
    apply, params = zf.functionalize(build())
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0),
                        zf.optim.adamw(3e-3, weight_decay=weight_decay, mask=zf.optim.decay_mask))
    step = zf.train_step(loss_of(apply), tx, accum=accum)
    if mesh is not None:
        step = zf.offload(zf.shard(step, mesh, 3, units=zf.units.by_class(unit)), optimizer="cpu")
    return step, step.init(params)


def fixtures_step(stage=None, offload=False, world=1):
    """``(step, params)`` of the model that tests/fixtures/make_deepspeed_checkpoints.py trains, with its
    AdamW (``ADAMW``): plain, sharded at ZeRO ``stage`` over ``world`` ranks, a pipeline of ``world``
    stages (``stage="pp"``, every rank given the whole batch), and/or with the optimizer state in CPU
    RAM (``offload``)."""
    from fixtures.make_deepspeed_checkpoints import ADAMW, model  # it imports this module

    net = model()
    apply, params = zf.functionalize(net)
    b1, b2 = ADAMW["betas"]
    opt = zf.optim.adamw(ADAMW["lr"], b1=b1, b2=b2, eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    step = zf.train_step(token_loss(apply), opt)
    if stage == "pp":
        step = zf.pipeline(step, stages=world, microbatches=2, model=net, units=zf.units.by_class(Block))
    elif stage is not None:
        step = zf.shard(step, zf.Mesh(dp=world), stage)
    if offload:
        step = zf.offload(step, optimizer="cpu")
    return step, params


def make_offloaded(clip=True, precision="fp32", accum=1, where=None, params=None, path=None, mesh=None, stage=None,
                   grad_norm=True, tiny=None, **kw):
    """``(step, state)`` of Tiny (``Tiny(**tiny)``) with Numba AdamW: plain, sharded (``stage``) and/or
    offloaded (``where``: the optimizer state's place, ``params``: the params' place, see ``zf.offload``)."""
    torch.manual_seed(0)
    apply, p = zf.functionalize(Tiny(**(tiny or {})))

    def loss_fn(p, batch):
        x, y, *skip = batch  # skip: a block the model leaves out (its params get no grad)
        return F.cross_entropy(apply(p, x, skip[0] if skip else None).flatten(0, 1).float(), y.flatten())

    step = zf.train_step(loss_fn, adamw(clip, backend="numba"), precision, accum, grad_norm=grad_norm)
    if stage:
        step = zf.shard(step, mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None)
    if where:
        units = zf.units.by_class(Block) if params and not stage else None
        step = zf.offload(step, where, params, path=path, units=units, **kw)
    return step, step.init(p)


# ------------------------------------------------------------------------------ training laws


def assert_same_training(got, ref, what: str, names=None) -> None:
    """``got`` and ``ref``: ``(losses, grad norms, params)`` of two trainings. Losses and norms agree
    per step (fp32: rtol 1e-5, atol 1e-6), and so do the params named in ``names`` (default: all of
    ``ref``'s), at atol 1e-5: Adam turns rounding in near-zero grads into +-lr steps."""
    (losses, norms, params), (ref_losses, ref_norms, ref_params) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=what)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6, msg=what)
    for name in ref_params if names is None else names:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")


def tree_equal(a, b) -> bool:
    la, lb = zf.tree.leaves(a), zf.tree.leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(la, lb))


class NormSpy:
    """Within ``with NormSpy(mesh) as spy``: ``spy.norms`` counts the calls of ``zf.optim.global_norm``
    and ``spy.labels`` lists the labels of the all-reduces ``mesh``'s comms issue."""

    def __init__(self, mesh):
        self.comms = {id(c): c for c in (mesh.comm, mesh.reduce_comm, mesh.pp_comm)}.values()
        self.norms, self.labels = 0, []

    def __enter__(self):
        self._global_norm = zf.optim.global_norm

        def counted(grads):
            self.norms += 1
            return self._global_norm(grads)

        zf.optim.global_norm = counted
        for comm in self.comms:
            def all_reduce(t, label="", async_op=False, _inner=comm.all_reduce):
                self.labels.append(label)
                return _inner(t, label=label, async_op=async_op)

            comm.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        zf.optim.global_norm = self._global_norm
        for comm in self.comms:
            del comm.all_reduce


# ------------------------------------------------------------------------------ faults


class PoisonGrad(torch.autograd.Function):
    """The identity in forward; backward sends inf: a finite loss with non-finite grads."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def inject(loss, fault):
    """``loss`` with ``fault``: "nan_loss", "inf_grads" (finite loss, inf grads) or None."""
    if fault == "nan_loss":
        return loss * float("nan")
    return PoisonGrad.apply(loss) if fault == "inf_grads" else loss


def with_faults(step, attribute="loss_fn"):
    """``step`` reading a fault to inject from its batch's third element (see ``inject``)."""
    inner = getattr(step, attribute)
    setattr(step, attribute, lambda p, b: inject(inner(p, b[:2]), b[2] if len(b) > 2 else None))
    return step


# ------------------------------------------------------------------------------ BatchNorm (carried buffers)


BN_STATS = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


class BNNet(nn.Module):
    """A tiny MLP with BatchNorm1d; ``mask`` adds a persistent buffer no forward writes."""

    def __init__(self, d_in=3, d=5, d_out=2, mask=False):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(d_in, d), nn.BatchNorm1d(d), nn.Linear(d, d_out)
        if mask:
            self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5]))

    def forward(self, x):
        h = F.relu(self.bn(self.fc1(x)))
        return self.fc2(h * self.mask if hasattr(self, "mask") else h)


def bn_batches(n=3, b=8, d_in=3, d_out=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, d_in, generator=g), torch.randn(b, d_out, generator=g)) for _ in range(n)]


def bn_step(model, accum=1, **kw):
    """``(apply, step)``: SGD with momentum on the mean squared error of ``model``."""
    apply, _ = zf.functionalize(model)
    step = zf.train_step(lambda p, batch: F.mse_loss(apply(p, batch[0]), batch[1]), zf.optim.sgd(0.1, momentum=0.9),
                         accum=accum, **kw)
    return apply, step


def torch_train(model, data, accum=1, ranks=1):
    """torch's own loop in train mode, SGD with momentum, on a copy of ``model``: ``ranks``
    replicas each on its slice of every batch, ``accum`` microbatches each, grads averaged; after
    each step the replicas' floating buffers are averaged (``zf.shard``'s law; DDP without
    SyncBatchNorm for the forward). Returns the trained replica 0."""
    replicas = [copy.deepcopy(model) for _ in range(ranks)]
    main = replicas[0]
    opt = torch.optim.SGD(main.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for mine, theirs in zip(rep.parameters(), main.parameters()):
                    mine.copy_(theirs)
            rep.zero_grad() if r else None
            for xc, yc in zip(x.chunk(ranks)[r].chunk(accum), y.chunk(ranks)[r].chunk(accum)):
                (F.mse_loss(rep(xc), yc) / (accum * ranks)).backward()
            if r:
                for mine, theirs in zip(main.parameters(), rep.parameters()):
                    mine.grad += theirs.grad
        opt.step()
        with torch.no_grad():
            for name, b in main.named_buffers():
                if b.is_floating_point():
                    b.copy_(torch.stack([rep.get_buffer(name) for rep in replicas]).double().mean(0))
            for rep in replicas[1:]:
                for name, b in rep.named_buffers():
                    b.copy_(main.get_buffer(name))
    return main


def assert_trained_like(state_params, state_buffers, ref, rtol=1e-6, atol=1e-6, names=None):
    """``state_params`` / ``state_buffers`` equal ``ref``'s (only ``names`` of them, if given)."""
    for n, p in ref.named_parameters():
        if names is None or n in names:
            torch.testing.assert_close(state_params[n], p.detach(), rtol=rtol, atol=atol, msg=n)
    for n, b in ref.named_buffers():
        if names is None or n in names:
            if b.is_floating_point():
                torch.testing.assert_close(state_buffers[n], b, rtol=rtol, atol=atol, msg=n)
            else:
                assert torch.equal(state_buffers[n], b), (n, state_buffers[n], b)


# ------------------------------------------------------------------------------ pipeline models


PIPE_STEPS = 3
PIPE_VOCAB = 13


class PipeTiny(nn.Module):
    """Embedding tied to the head (a param of both end stages), blocks in an nn.ModuleList.
    ``order`` runs the blocks out of module order; ``between`` scales x between blocks 1 and 2;
    ``reuse`` reads a block's param in the head: three things a pipeline must refuse."""

    def __init__(self, d=6, n=4, order=None, between=False, reuse=False):
        super().__init__()
        self.emb = nn.Embedding(PIPE_VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, PIPE_VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.order, self.between, self.reuse = order or list(range(n)), between, reuse

    def forward(self, idx):
        x = self.emb(idx)
        for i in self.order:
            x = self.blocks[i](x)
            if self.between and i == 1:
                x = 2 * x
        x = self.ln_f(x)
        return self.head(x * self.blocks[0].ln.weight if self.reuse else x)


def pipe_batches(b=8, n=PIPE_STEPS):
    g = torch.Generator().manual_seed(1)

    def tokens():
        return torch.randint(0, PIPE_VOCAB, (b, 5), generator=g)

    return [(tokens(), tokens()) for _ in range(n)]


class NormUnit(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.bn(self.fc(x))


class NormStack(nn.Module):
    """Pipeline units with BatchNorm; ``stem`` or ``head`` adds one outside the units."""

    def __init__(self, d=5, n=2, stem=False, head=False):
        super().__init__()
        self.inp, self.out = nn.Linear(3, d), nn.Linear(d, 2)
        self.stem = nn.BatchNorm1d(d) if stem else nn.Identity()
        self.blocks = nn.ModuleList(NormUnit(d) for _ in range(n))
        self.head = nn.BatchNorm1d(d) if head else nn.Identity()

    def forward(self, x):
        x = self.stem(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(self.head(x))


def norm_step(mesh=None, schedule="gpipe", **model_kw):
    torch.manual_seed(0)
    model = NormStack(**model_kw)
    _, step = bn_step(model, accum=1 if mesh else 2)
    if mesh:
        step = zf.pipeline(step, stages=mesh.pp, microbatches=2, schedule=schedule, model=model,
                           units=zf.units.by_class(NormUnit))
    return step, step.init(zf.functionalize(model)[1])


# ------------------------------------------------------------------------------ others


def fp16_dropout_step():
    """A plain step with everything resume must carry: fp16 loss scale, dropout RNG, Adam moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 13))
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).float().flatten(0, 1), y.flatten())

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), precision="fp16", seed=3)
    return step, step.init(params).replace(loss_scale=zf.precision.LossScale(2.0**10, 0, growth_interval=3))


def untile(params):
    """``x.tiles.i.weight`` entries concatenated into ``x.weight`` (tiles over rows, dim 0)."""
    out = {}
    for name, p in params.items():
        head, sep, rest = name.partition(".tiles.")
        out.setdefault(f"{head}.{rest.partition('.')[2]}" if sep else name, []).append(p)
    return {n: torch.cat(ps) for n, ps in out.items()}


def hf_model(kind):
    if kind == "recipe-gpt":
        from recipes.gpt import GPT, Block as GPTBlock, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32)), GPTBlock
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16, bos_token_id=0, eos_token_id=0,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # dropout masks depend on the batch split
        return GPT2LMHeadModel(cfg), GPT2Block
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=61, max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


# A script's lines that make the next checkpoint save stall once its rank file is written (before
# the manifest) and print "mid-save": where ``kill_mid_save`` kills it. The script imports
# ``time`` and ``zfunc.checkpoint.files as cf``.
STALL_MID_SAVE = """
write = cf.write_safetensors
def stuck(path, tensors, *pace):   # mid-save: the rank file is written, the manifest is not
    write(path, tensors, *pace)
    print("mid-save", flush=True)
    time.sleep(60)
cf.write_safetensors = stuck
"""


def kill_mid_save(code: str) -> None:
    """Run ``code`` in a fresh interpreter until it prints "mid-save", then kill it (SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-save"
    finally:
        proc.kill()
        proc.wait()
