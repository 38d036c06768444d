"""Train a small byte-level GPT with zfunc: `python -m recipes.gpt` (`--help` for flags).

nanoGPT in one file: the config, the model (plain torch, no zfunc), the data, and a flat training
loop driven by a zfunc Step. With no flags it trains on the Python standard library's own source
(bytes, vocab 256) and reaches val loss <= 2.4 nats/byte in about 5 minutes on a 2-core CPU.
On a GPU the same command uses it and reports MFU.

At scale, the same command under torchrun (`torchrun --nproc_per_node 4 -m recipes.gpt --zero 3
--offload-optimizer cpu`, or `--deepspeed ds_config.json`): the layout flags (recipes/layout.py)
make a `zf.config.Plan` that `zf.parallelize` applies; `--batch-size` is the global batch, so the
same flags train the same on any layout, and `--resume` continues in another one. Rank 0 writes
OUT/metrics.jsonl and OUT/loss.png (recipes/watch.py).
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import layout
from recipes.data import MAX_CORPUS_BYTES, VAL_PERCENT, get_batch, is_val as _is_val, load_bytes as load_corpus  # noqa: F401
from recipes import watch as watch_mod
from recipes.layout import FlagError

# ----------------------------------------------------------------------------- config
# Tuned for ~5 minutes on a 2-core CPU; every key is also a flag (n_layer -> --n-layer).
DEFAULTS = dict(
    n_layer=4, n_head=4, n_embd=192, block_size=128, dropout=0.0,  # 1.85M params
    steps=600, batch_size=32, accum=1,  # 4,096 tokens per step
    lr=3e-3, end_lr=3e-4, warmup=40, weight_decay=0.1, grad_clip=1.0,  # AdamW(0.9, 0.95), cosine
    precision=None, device=None, data=None, out="out/gpt", seed=1337,
    eval_every=100, eval_batches=20, ckpt_every=200, keep_last=2, resume=False, log_every=10,
    sample_len=300, temperature=0.8, top_k=40,
    **layout.LAYOUT_DEFAULTS,  # --zero, --offload-*, --remat, --pp, --deepspeed, ...: how, not what
)
UNITS = "class:Block"  # ZeRO-3 gathers, remat and pipeline stages go block by block
HELP = dict(
    block_size="context length in bytes",
    batch_size="global batch: sequences per optimizer step, over all processes; split over the data-parallel "
               "ranks, then into --accum (with --pp: --microbatches) microbatches, so the same flags train the "
               "same on any number of processes and layout",
    accum="gradient accumulation: microbatches each rank's share of the batch is cut into",
    lr="peak learning rate (after linear warmup)",
    end_lr="learning rate at the end of the cosine decay", warmup="linear warmup steps (at most half of --steps)",
    grad_clip="max global grad norm", precision="default: bf16 on CUDA, fp32 on CPU",
    device="default: cuda if available, else cpu", out="output dir (checkpoints in OUT/ckpt)",
    eval_every="evaluate every N steps; 0: never (the last step always evaluates)",
    ckpt_every="save a checkpoint every N steps; 0: never (the last step always saves)",
    keep_last="checkpoints to keep (>= 1)",
    resume="continue from OUT/ckpt/latest: the flags that shape training must be those it was saved with; "
           "--steps (above the checkpoint's step; the cosine is laid over the new total), --device, "
           "--out, the eval, log, checkpoint and sample flags and the layout (--zero, --offload-*, --remat, --pp, "
           "--microbatches, --accum, --deepspeed, the number of processes) may change",
    log_every="log a line to OUT/metrics.jsonl (and the bar) every N steps (eval steps always)",
    **layout.LAYOUT_HELP,
    data="text file or folder (default: the Python stdlib's .py files)",
    sample_len="bytes to generate at the end", top_k="sample from the k likeliest bytes (256: all)",
)
# A resumed run may change these; every other flag shapes the training, is saved in each checkpoint,
# and must match it (else --resume names each difference).
MAY_CHANGE_ON_RESUME = ("steps", "device", "out", "resume", "eval_every", "eval_batches", "ckpt_every",
                        "keep_last", "log_every", "sample_len", "temperature", "top_k", *layout.MAY_CHANGE_ON_RESUME)


# ----------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Pre-LN GPT: learned positions, tied input/output embeddings; forward(idx) -> logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def initial_value(self, name: str, like: torch.Tensor, seed: int, rows: slice | None = None) -> torch.Tensor:
        """The initial value of param ``name`` (GPT-2's init, as ``__init__`` draws it), whole or its
        dim-0 ``rows``: a ``zf.materialize`` materializer. Values depend only on ``(seed, name, row)``
        (``zf.materialize.normal``'s law): the same whatever the layout, the number of processes or the
        order leaves are made in, so a model built on the meta device can be materialized rank by rank
        (ZeRO-3: each rank draws only its rows; offload: leaf by leaf) and train exactly as one built
        whole. A tile of a layer split along dim 0 (``zf.tile``) is its rows of the whole layer's value.
        Cost: the rows asked for (plus at most two 1 MiB blocks being drawn)."""
        import zfunc as zf

        owner, _, kind = name.rpartition(".")
        layer, _, index = owner.rpartition(".")
        if layer.endswith(".tiles") and index.isdigit():  # a tile: its rows of the whole layer
            sizes = [getattr(t, kind).shape[0] for t in self.get_submodule(layer)]
            start, mine = sum(sizes[: int(index)]), rows or slice(0, sizes[int(index)])
            whole = torch.empty((sum(sizes), *like.shape[1:]), dtype=like.dtype, device="meta")
            return self.initial_value(f"{layer.removesuffix('.tiles')}.{kind}", whole, seed,
                                      slice(start + mine.start, start + mine.stop))
        return zf.materialize.leaf(self._rule(owner, kind, seed), name, like, rows)

    def _rule(self, owner: str, kind: str, seed: int):
        """The materializer of a param of submodule ``owner`` (GPT-2's init)."""
        import zfunc as zf

        if isinstance(self.get_submodule(owner), nn.LayerNorm):
            return zf.materialize.constant(1.0 if kind == "weight" else 0.0)
        if kind == "bias":
            return zf.materialize.constant(0.0)
        residual = owner.endswith("proj") or owner.endswith("mlp.2")
        return zf.materialize.normal(0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02, seed)

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


@torch.no_grad()
def generate(model_fn, prompt: bytes, length: int, block_size: int, temperature=0.8, top_k=40,
             generator=None, device="cpu") -> bytes:
    """Sample `length` bytes after `prompt`; model_fn(idx) -> logits (a model or a closure)."""
    idx = torch.tensor(list(prompt or b"\n"), dtype=torch.long, device=device)[None]
    for _ in range(length):
        logits = model_fn(idx[:, -block_size:])[:, -1, :].float() / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0, -length:].tolist()) if length else b""


# ----------------------------------------------------------------------------- data
# Bytes (vocab 256) of a text file or folder, or by default the stdlib's *.py files, split into train/val by a
# stable hash of each file's path; random windows of them. One implementation: recipes/data.py.


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte histogram in nats/byte: the loss of a model that ignores context."""
    p = torch.bincount(data.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# ----------------------------------------------------------------------------- training
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}  # dense


def peak_flops(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _parser(with_defaults: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.gpt", description=__doc__.split("\n\n")[0],
                                argument_default=None if with_defaults else argparse.SUPPRESS)
    for name, default in DEFAULTS.items():
        kw = {} if with_defaults else {"default": argparse.SUPPRESS}
        if isinstance(default, bool):
            p.add_argument(_flag(name), action="store_true", help=HELP.get(name), **kw)
            continue
        choices = ["fp32", "bf16", "fp16"] if name == "precision" else layout.CHOICES.get(name)
        p.add_argument(_flag(name), type=str if default is None else type(default), choices=choices,
                       **({"default": default} if with_defaults else kw),
                       help=f"{HELP.get(name, '')} (default: %(default)s)".lstrip())
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Every key of DEFAULTS is a flag: n_layer -> --n-layer (their values are checked by check_args);
    ``args.given`` names the flags given on the command line (a --deepspeed config's values yield to them)."""
    args = _parser().parse_args(argv)
    args.given = frozenset(vars(_parser(with_defaults=False).parse_args(argv)))
    return args


_AT_LEAST_1, _AT_LEAST_0 = (lambda v: v >= 1, "an int >= 1"), (lambda v: v >= 0, "an int >= 0")
_FINITE_AT_LEAST_0 = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
RULES = dict(  # flag: (test, what is expected)
    n_layer=_AT_LEAST_1, n_head=_AT_LEAST_1, n_embd=_AT_LEAST_1, block_size=_AT_LEAST_1, steps=_AT_LEAST_1,
    batch_size=_AT_LEAST_1, accum=_AT_LEAST_1, eval_batches=_AT_LEAST_1, keep_last=_AT_LEAST_1, top_k=_AT_LEAST_1,
    log_every=_AT_LEAST_1, warmup=_AT_LEAST_0, eval_every=_AT_LEAST_0, ckpt_every=_AT_LEAST_0, sample_len=_AT_LEAST_0,
    seed=(lambda v: 0 <= v < 2**32, "an int in [0, 2**32)"), dropout=(lambda v: 0 <= v < 1, "a number in [0, 1)"),
    lr=_FINITE_AT_LEAST_0, end_lr=_FINITE_AT_LEAST_0, weight_decay=_FINITE_AT_LEAST_0,
    grad_clip=(lambda v: v > 0, "a number > 0"), temperature=(lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
)
_flag = layout.flag


def device_of(args: argparse.Namespace) -> torch.device:
    return layout.Launch.from_env().device(args.device)


def with_precision(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with --precision resolved (bf16 on CUDA, fp32 on CPU when not given)."""
    precision = args.precision or ("bf16" if device_of(args).type == "cuda" else "fp32")
    return argparse.Namespace(**{**vars(args), "precision": precision})


def training_flags(args: argparse.Namespace, plan=None) -> dict:
    """The flags that shape the training, as saved in every checkpoint (precision, data and a
    --deepspeed config's optimizer resolved)."""
    flags = {k: getattr(args, k) for k in DEFAULTS if k not in MAY_CHANGE_ON_RESUME}
    flags["precision"] = with_precision(args).precision
    flags["data"] = args.data and str(Path(args.data).resolve())
    flags["deepspeed_optimizer"] = layout.deepspeed_optimizer(plan) if plan is not None else None
    return flags


def check_args(args: argparse.Namespace) -> None:
    """Check every flag before anything is built: each value (RULES), the layout flags and the
    global batch's split over the processes (recipes/layout.py, a --deepspeed config included),
    --data, --device, that --out is writable (creating OUT/ckpt), and that --resume finds a
    checkpoint saved with these training_flags at a step below --steps. Raises FlagError naming
    each flag, its value and what was expected."""
    launch = layout.Launch.from_env()
    errors = [f"{_flag(k)}: expected {want}, got {getattr(args, k)!r}"
              for k, (ok, want) in RULES.items() if not ok(getattr(args, k))]
    if args.n_head >= 1 and args.n_embd % args.n_head:
        errors.append(f"--n-embd: expected a multiple of --n-head {args.n_head}, got {args.n_embd}")
    errors += layout.check_layout_args(args, launch.world)
    if args.data is not None and not Path(args.data).exists():
        errors.append(f"--data: path {args.data!r} does not exist")
    try:
        device = device_of(args)
        if device.type == "cuda" and not torch.cuda.is_available():
            errors.append(f"--device: {args.device!r} asked for, but CUDA is not available")
    except RuntimeError as e:
        errors.append(f"--device: expected a torch device such as cpu or cuda:0, got {args.device!r} ({e})")
    if errors:
        raise FlagError("\n".join(errors))
    plan, args = layout.resolve(with_precision(args), launch.world, UNITS, notices=False)
    ckpt_root = Path(args.out) / "ckpt"
    try:  # now, not at the first save after all the training
        ckpt_root.mkdir(parents=True, exist_ok=True)
        probe = ckpt_root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FlagError(f"--out: cannot write checkpoints under {str(ckpt_root)!r} ({e})") from e
    if args.resume:
        check_resume(args, ckpt_root, plan)


def check_resume(args: argparse.Namespace, ckpt_root: Path, plan=None) -> None:
    import zfunc as zf

    latest = zf.checkpoint.latest(ckpt_root)
    if latest is None:
        raise FlagError(f"--resume: no checkpoint under {ckpt_root}")
    manifest = zf.checkpoint.read_manifest(latest)
    extra = manifest.get("extra", {})
    saved = extra.get("flags") or extra.get("config", {})  # "config" alone: a checkpoint from before flags were saved
    given = training_flags(args, plan)
    name = lambda k: _flag(k) if k in DEFAULTS else "the optimizer and scheduler of --deepspeed"  # noqa: E731
    differ = [f"  {name(k)}: {saved[k]!r} in the checkpoint, {given[k]!r} given"
              for k in sorted(saved) if k in given and saved[k] != given[k]]
    if differ:
        raise FlagError(f"--resume: {latest} was saved by a run with other flags; pass its flags (or another "
                        "--out to start afresh):\n" + "\n".join(differ))
    if args.steps <= manifest["step"]:
        raise FlagError(f"--steps: {args.steps} is not beyond step {manifest['step']} of the checkpoint {latest} "
                        f"resumed: nothing to train (pass --steps above {manifest['step']})")


def make_optimizer(args: argparse.Namespace, plan):
    """AdamW(0.9, 0.95) on a warmup-cosine, decaying matrices only; a --deepspeed config's optimizer
    and scheduler when it names them (a config without a scheduler keeps its lr constant, as in
    DeepSpeed). Clipping at the plan's gradient_clipping (--grad-clip, or the config's; 0: none)."""
    import zfunc as zf

    if plan.optimizer is not None:
        return zf.config.optimizer(plan, args.steps, mask=zf.optim.decay_mask)
    lr = (zf.config.schedule(plan, args.steps) if plan.scheduler is not None else
          zf.optim.warmup_cosine(args.lr, min(args.warmup, args.steps // 2), args.steps, end_value=args.end_lr))
    adamw = zf.optim.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay, mask=zf.optim.decay_mask)
    if plan.gradient_clipping > 0:
        return zf.optim.chain(zf.optim.clip_by_global_norm(plan.gradient_clipping), adamw)
    return adamw


def first_state(args: argparse.Namespace, step, model: GPT, params: dict, plan, device: torch.device):
    """The state to train from: OUT/ckpt/latest loaded into this layout (--resume), or a fresh one
    from meta-device ``params``. A step that can materialize leaf by leaf (offload; ZeRO-3) makes
    each rank's rows one leaf at a time, never the whole model; the others get whole params."""
    import zfunc as zf

    if args.resume:
        latest = zf.checkpoint.latest(Path(args.out) / "ckpt")
        if latest is None:
            raise FlagError(f"--resume: no checkpoint under {Path(args.out) / 'ckpt'}")  # removed since check_args
        try:  # zf.checkpoint.load checks the model's params against the checkpoint's
            return zf.checkpoint.load(latest, step, params=params, device=device), latest
        except zf.checkpoint.CheckpointError as e:
            raise FlagError(f"--resume: {e}") from e

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        return model.initial_value(name, like, args.seed, rows)

    if "materialize" in inspect.signature(step.init).parameters:
        state = step.init(params, materialize=materialize)
    else:
        state = step.init({name: materialize(name, like).to(device) for name, like in params.items()})
    if plan.precision == "fp16":  # the plan's (a DeepSpeed config's) loss-scale rule
        state = state.replace(loss_scale=zf.precision.deepspeed_loss_scale(
            plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.min_loss_scale,
            plan.consecutive_hysteresis))
    return state, None


def describe(args, plan, launch, cfg: GPTConfig, model: GPT, device) -> list[str]:
    """What rank 0 says about the model and the layout before training."""
    lines = [f"model: {model.num_params(non_embedding=False) / 1e6:.2f}M params {asdict(cfg)}; device {device}, "
             f"precision {plan.precision}; {args.steps} steps x {args.batch_size * cfg.block_size:,} tokens",
             f"layout: {launch.world} process{'es' * (launch.world > 1)}, dp={plan.dp} pp={plan.pp}, ZeRO "
             f"{plan.zero_stage}, offload optimizer {plan.offload_optimizer} params {plan.offload_params}, remat "
             f"{plan.remat}; per rank {args.batch_size // plan.dp} sequences in "
             f"{plan.microbatches if plan.pp > 1 else plan.accum} microbatches"]
    return lines


def train(args: argparse.Namespace) -> dict:
    """Train per `args` (from parse_args); returns the final numbers, sample and checkpoint path
    (on rank 0; the other ranks return what they know)."""
    import zfunc as zf  # the model and data above are plain torch; only training needs zfunc

    check_args(args)  # before anything is built
    t_start = time.time()
    launch = layout.Launch.from_env()
    plan, args = layout.resolve(with_precision(args), launch.world, UNITS, notices=launch.rank == 0)
    say = print if launch.rank == 0 else (lambda *a, **k: None)
    if launch.rank != 0:
        warnings.simplefilter("ignore")  # other ranks print nothing but errors
    launch.start()
    device, flags, precision = launch.device(args.device), training_flags(args, plan), plan.precision
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    corpus = load_corpus(args.data)
    baseline = unigram_entropy(corpus.val)
    say(f"data: {corpus.source}: {corpus.n_files} files, {len(corpus.train):,} train / "
        f"{len(corpus.val):,} val bytes; unigram entropy of val {baseline:.3f} nats/byte")
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        if len(data) <= args.block_size + 1:  # found now, not at the first batch or eval
            raise FlagError(f"--block-size: {args.block_size} needs more than {args.block_size + 1} bytes, the "
                            f"{split} split of --data {corpus.source!r} has {len(data)}")

    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dropout=args.dropout)
    with torch.device("meta"):  # no memory yet: each leaf is made once, where the layout keeps it
        model = GPT(cfg)
    for line in describe(args, plan, launch, cfg, model, device):
        say(line)
    zf.parallelize.prepare(model, plan)  # tile the head, remat the blocks: before functionalize
    apply, params = zf.functionalize(model)

    def loss_fn(params, batch):
        x, y = batch
        logits = apply(params, x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    step = zf.train_step(loss_fn, make_optimizer(args, plan), precision=precision, accum=plan.accum, seed=args.seed)
    mesh = zf.Mesh(dp=plan.dp, pp=plan.pp)
    step = zf.parallelize(step, model, plan, mesh)  # shard -> offload -> pipeline, as the plan says
    state, resumed = first_state(args, step, model, params, plan, device)
    if resumed is not None:
        say(f"resumed from {resumed} at step {state.step}")
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    @torch.no_grad()
    def evaluate(params) -> float:
        model.eval()
        gen, total = torch.Generator().manual_seed(0), 0.0  # the same val batches every time
        for _ in range(args.eval_batches):
            x, y = get_batch(corpus.val, args.batch_size, cfg.block_size, gen, device)
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                total += loss_fn(params, (x, y)).item()
        model.train()
        return total / args.eval_batches

    def save(n: int, val_loss: float):
        return zf.checkpoint.save(state, Path(args.out) / "ckpt" / f"{n:06d}", keep_last=args.keep_last,
                                  extra={"config": asdict(cfg), "flags": flags, "val_loss": val_loss})

    def my_rows(batch):  # this rank's share of the global batch: its dp slice (a pipeline's stages: the same)
        per_rank = args.batch_size // plan.dp
        return tuple(t[mesh.rank * per_rank:(mesh.rank + 1) * per_rank].to(device) for t in batch)

    first, tokens_per_step = state.step, args.batch_size * cfg.block_size
    flops_per_token = 6 * model.num_params() + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd
    watch = watch_mod.Watch(Path(args.out), launch.rank, first if args.resume else None,
                            flops_per_token=flops_per_token, peak_flops=peak_flops(device), world=launch.world)
    history, train_time, loss, val_loss, whole = [], 0.0, float("nan"), float("nan"), None
    last_logged, log_time = first, 0.0
    t0 = time.time()
    for i in watch.progress(range(first, args.steps), first, args.steps):
        # Step i's batch depends on (seed, i) alone, so a resumed run, in any layout, sees the same data.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        batch = my_rows(get_batch(corpus.train, args.batch_size, cfg.block_size, gen))
        state, metrics = step(state, batch)
        n = i + 1
        do_eval = (args.eval_every and n % args.eval_every == 0) or n == args.steps
        if n % args.log_every == 0 or do_eval:  # .item() syncs the GPU: read metrics only now and then
            loss = metrics["loss"].item()
            elapsed = time.time() - t0
            train_time, log_time = train_time + elapsed, log_time + elapsed
            tokens_per_s = (n - last_logged) * tokens_per_step / max(log_time, 1e-9)
            peak_mem = watch_mod.every_rank(watch_mod.peak_memory_bytes(device), launch.world)
            if do_eval:
                whole = layout.whole_params(state, mesh)  # every rank takes part; rank 0 evaluates
                if launch.rank == 0:
                    val_loss = evaluate(whole)
                    history.append((n, val_loss))
            watch.record(n, metrics, tokens_per_s, peak_mem, val_loss if do_eval else None)
            if do_eval:
                watch.say(f"step {n}: train loss {loss:.3f}, val loss {val_loss:.3f} ({time.time() - t_start:.0f} s)")
            last_logged, log_time, t0 = n, 0.0, time.time()
        if args.ckpt_every and n % args.ckpt_every == 0 and n != args.steps:
            save(n, val_loss)
            t0 = time.time()
    watch.close()

    tokens_per_s = (args.steps - first) * tokens_per_step / max(train_time, 1e-9)
    peak = peak_flops(device)
    mfu = flops_per_token * tokens_per_s / (peak * launch.world) if peak else None
    say(f"final val loss {val_loss:.3f} nats/byte (unigram baseline {baseline:.3f}) after "
        f"{args.steps} steps; {tokens_per_s:,.0f} tokens/s; elapsed {time.time() - t_start:.0f} s")
    if device.type == "cuda":
        say(f"MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s bf16 peak per GPU" if mfu is not None else
            f"MFU unknown: no peak FLOP/s on record for {torch.cuda.get_device_name(device)}")

    ckpt = save(args.steps, val_loss)
    if ckpt is not None:
        say(f"saved {ckpt}")

    sample = b""
    if launch.rank == 0:
        model.eval()
        sample = generate(lambda idx: apply(whole, idx), b"def ", args.sample_len, cfg.block_size, args.temperature,
                          args.top_k, torch.Generator().manual_seed(args.seed), device)
        say("sample:\n" + (b"def " + sample).decode("utf-8", errors="replace"))
    return dict(val_loss=val_loss, train_loss=loss, unigram_entropy=baseline, history=history,
                steps=args.steps, n_params=model.num_params(non_embedding=False), tokens_per_s=tokens_per_s, mfu=mfu,
                elapsed_s=time.time() - t_start, checkpoint=str(ckpt) if ckpt is not None else None, sample=sample,
                rank=launch.rank)


def main(argv=None) -> dict:
    """The command line; flags that cannot work exit with status 2 and their message, as argparse's do."""
    args = parse_args(argv)
    try:
        return train(args)
    except FlagError as e:
        print(f"python -m recipes.gpt: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e


if __name__ == "__main__":
    main()
