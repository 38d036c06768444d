"""How a recipe trains at scale: the flags every recipe shares, the launch, and the plan they make.

The flags (``LAYOUT_DEFAULTS``) say how to lay the training out, never what is trained: ZeRO
stage, offload, remat, LM-head tiling, pipeline, sequence and tensor parallelism, a DeepSpeed
config. ``resolve(args, world, units)`` turns them (and ``--deepspeed``) into a ``zf.config.Plan``,
which ``zf.parallelize`` applies; the recipe never calls shard/offload/pipeline itself. ``Launch`` reads torchrun's
environment (``python -m recipes.gpt`` is one process, ``torchrun ... -m recipes.gpt`` N of them,
on one machine or several). ``--batch-size`` is the global batch: split over the dp ranks, then
into accumulation (or pipeline) microbatches, so the same flags train the same on any layout.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class FlagError(ValueError):
    """Flags that cannot work together; the message names each flag, its value and what was expected."""


LAYOUT_DEFAULTS = dict(
    zero=0, offload_optimizer="none", offload_params="none", nvme_path=None, keep_swap=False, remat=False,
    remat_offload=False, tile_lm_head=0, pp=1, microbatches=1, schedule="1f1b", virtual_stages=1, deepspeed=None,
    quantize_weights=False, quantize_grads=0, sp=1, sp_kind="ulysses", tile_mlp=0, tp=1, tp_sequence_parallel=False,
)
CHOICES = dict(zero=[0, 1, 2, 3], offload_optimizer=["none", "cpu", "nvme"], offload_params=["none", "cpu", "nvme"],
               schedule=["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv"], quantize_grads=[0, 4, 8],
               optimizer=["adamw", "onebit_adam", "zero_one_adam", "onebit_lamb"], sp_kind=["ulysses", "ring"])
LAYOUT_HELP = dict(
    zero="ZeRO stage: 0 replicated data parallel, 1 optimizer state, 2 + grads, 3 + params sharded over the ranks",
    offload_optimizer="keep the optimizer state (and fp32 masters' update) in CPU RAM or NVMe (ZeRO 1-3, or 1 rank)",
    offload_params="keep the fp32 params in CPU RAM or NVMe, fetched per unit (ZeRO 3, or 1 rank); needs "
                   "--offload-optimizer",
    nvme_path="directory for the NVMe swap files (each rank uses its own folder in it); a run that ends cleanly "
              "removes its files and the folders it made for them",
    keep_swap="keep the NVMe swap files (and their spares) after the run ends",
    remat="recompute each unit's (block's) activations in backward (activation checkpointing)",
    remat_offload="with --remat: keep each unit's saved inputs in CPU RAM",
    tile_lm_head="compute the LM head (and an embedding tied to it) in this many tiles; 0: untiled",
    pp="pipeline stages (the world size must be a multiple; dp = world size / pp)",
    microbatches="with --pp: microbatches each rank's batch is cut into (in place of --accum)",
    schedule="pipeline schedule (zero-bubble: ZB-H1, the backward split into input and weight grads; zbv: ZB-V, two "
             "stages per rank in a V)",
    virtual_stages="with --schedule interleaved-1f1b: virtual pipeline stages per rank (units placed round-robin)",
    quantize_weights="ZeRO++ (--zero 3): all-gather the params as block-quantized int8",
    quantize_grads="ZeRO++ (--zero 1-3): reduce-scatter the grads in 4 or 8 bits (0: fp32)",
    sp="sequence-parallel ranks: each computes 1/sp of every sequence's tokens, attention sees them all "
       "(dp = world size / (pp * sp); the ranks of a sequence group read the same batch)",
    sp_kind="with --sp: how attention sees the whole sequence: an all-to-all to all tokens of 1/sp of the heads "
            "(ulysses: sp must divide the heads) or key/value blocks passed round the ranks (ring: any heads)",
    tile_mlp="run each unit's MLP over this many token tiles, each recomputed in backward; 0: untiled",
    tp="tensor-parallel ranks: each holds 1/tp of every attention and MLP projection and of the vocabulary's rows "
       "(Megatron's column- and row-parallel layers, the plan found from the model; dp = world size / (pp * sp * "
       "tp); the ranks of a tp group read the same batch)",
    tp_sequence_parallel="Megatron's sequence parallelism, with --tp: the norms, dropout and residual adds between "
                         "the tp regions run on 1/tp of the tokens each (a reduce-scatter and an all-gather in place "
                         "of each all-reduce), so their activations divide by tp",
    deepspeed="a DeepSpeed JSON config; its 'auto' values (and its batch sizes, if it gives none) come from these "
              "flags, and a flag given that contradicts it is an error",
)
# The layout may change on --resume: a checkpoint loads into any stage, offload or world size.
MAY_CHANGE_ON_RESUME = ("zero", "offload_optimizer", "offload_params", "nvme_path", "keep_swap", "remat",
                        "remat_offload", "pp", "microbatches", "schedule", "deepspeed", "accum", "quantize_weights",
                        "quantize_grads", "sp", "sp_kind", "tile_mlp", "virtual_stages", "tp", "tp_sequence_parallel")
# Plan field -> the flag that sets it, to name flags in the plan's errors.
FLAG_OF_FIELD = dict(dp="--pp", pp="--pp", zero_stage="--zero", offload_optimizer="--offload-optimizer",
                     offload_params="--offload-params", nvme_path="--nvme-path", remat="--remat",
                     remat_offload="--remat-offload", tile_lm_head="--tile-lm-head", microbatches="--microbatches",
                     pipeline_schedule="--schedule", precision="--precision", accum="--accum",
                     gradient_clipping="--grad-clip", global_batch="--batch-size", micro_batch="--batch-size",
                     quantized_weights="--quantize-weights", quantized_grads="--quantize-grads",
                     sp_size="--sp", sp_kind="--sp-kind", tile_mlp="--tile-mlp",
                     virtual_stages="--virtual-stages", tp="--tp", sp="--tp-sequence-parallel")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class Launch:
    """This process's place: ``world`` processes, global ``rank``, ``local_rank`` on its machine
    (torchrun's WORLD_SIZE, RANK, LOCAL_RANK; one process alone without them)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    planned: bool = False  # a dry run in one process, planning rank 0 of ``world`` (no process group)

    @classmethod
    def of(cls, args: argparse.Namespace) -> Launch:
        """``from_env``; but a dry run in one process plans rank 0 of --world-size processes (0: the
        fewest its layout needs, pp * sp * tp), as ``torchrun --nproc_per_node N`` would run it."""
        launch = cls.from_env()
        if "WORLD_SIZE" in os.environ or not getattr(args, "dry_run", False):
            return launch
        given = getattr(args, "world_size", 0)
        fewest = max(1, args.pp) * max(1, args.sp) * max(1, args.tp)
        world = given if isinstance(given, int) and given > 0 else fewest
        return cls(world, 0, 0, planned=True) if world > 1 else launch

    @classmethod
    def from_env(cls) -> Launch:
        if "WORLD_SIZE" not in os.environ:
            return cls()
        try:
            world, rank, local_rank = (int(os.environ.get(k, "0")) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        except ValueError as e:
            raise FlagError(f"torchrun environment: WORLD_SIZE, RANK, LOCAL_RANK must be ints ({e})") from None
        shown = f"WORLD_SIZE={world}, RANK={rank}, LOCAL_RANK={local_rank}"
        if world < 1 or not 0 <= rank < world or not 0 <= local_rank < world:
            raise FlagError(f"torchrun environment: expected WORLD_SIZE >= 1 and RANK, LOCAL_RANK in [0, WORLD_SIZE), "
                            f"got {shown}")
        return cls(world, rank, local_rank)

    def start(self) -> None:
        """Join the process group (torchrun's rendezvous; gloo on CPU, NCCL on CUDA); a planned
        launch joins none."""
        if self.world > 1 and not self.planned:
            import zfunc as zf

            zf.dist.init_from_env()

    def device(self, given: str | None) -> torch.device:
        """``given`` (default cuda if available, else cpu); a bare "cuda" is this rank's GPU, with its
        index (``torch.cuda.set_device`` takes no bare "cuda")."""
        device = torch.device(given or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.local_rank if self.world > 1 else 0)
        return device


# ----------------------------------------------------------------------------- flags -> plan


def check_layout_args(args: argparse.Namespace, world: int) -> list[str]:
    """The layout flags' own values and the global batch's split over ``world`` processes."""
    errors = []
    for name in ("pp", "microbatches", "sp", "virtual_stages", "tp"):
        if getattr(args, name) < 1:
            errors.append(f"{flag(name)}: expected an int >= 1, got {getattr(args, name)}")
    for name in ("tile_lm_head", "tile_mlp"):
        if getattr(args, name) < 0:
            errors.append(f"{flag(name)}: expected an int >= 0, got {getattr(args, name)}")
    if args.deepspeed is not None and not Path(args.deepspeed).is_file():
        errors.append(f"--deepspeed: no DeepSpeed config file at {args.deepspeed!r}")
    if not errors and world % (args.pp * args.sp * args.tp):
        if args.tp > 1:
            named = [n for n, v in (("pp", args.pp), ("sp", args.sp), ("tp", args.tp)) if v > 1]
            errors.append(f"{', '.join('--' + n for n in named)}: {args.pp * args.sp * args.tp} ranks per replica "
                          f"({' * '.join(named)}) do not divide the {world} processes (expected a divisor of {world})")
        elif args.sp == 1:
            errors.append(f"--pp: {args.pp} stages do not divide the {world} processes (expected a divisor of {world})")
        else:
            errors.append(f"{'--sp' if args.pp == 1 else '--pp, --sp'}: {args.pp * args.sp} ranks per replica "
                          f"(pp * sp) do not divide the {world} processes (expected a divisor of {world})")
    if errors or args.deepspeed is not None:
        return errors  # with a DeepSpeed config the batch split is checked once its values are read
    return check_batch_split(args, world // (args.pp * args.sp * args.tp))


def check_batch_split(args: argparse.Namespace, dp: int) -> list[str]:
    split, what = (args.microbatches, "pipeline microbatches") if args.pp > 1 else (args.accum, "accumulation steps")
    if split < 1 or args.batch_size < 1:
        return []  # reported by their own checks
    if args.batch_size % (dp * split):
        return [f"--batch-size: the global batch of {args.batch_size} sequences must split over {dp} data-parallel "
                f"rank{'s' * (dp > 1)} x {split} {what}; expected a multiple of {dp * split}"]
    return []


def resolve(args: argparse.Namespace, world: int, units: str | None, *, notices: bool = True
            ) -> tuple[Any, argparse.Namespace]:
    """``(plan, args)``: the ``zf.config.Plan`` the flags (and ``--deepspeed``) ask for on
    ``world`` processes, and the flags with the DeepSpeed config's values filled in. Raises
    ``FlagError`` naming the flags (and config keys) of a plan that cannot work. ``notices``:
    show the DeepSpeed reader's notice of ignored keys (once per run: the recipe's last call)."""
    import zfunc as zf

    errors = check_layout_args(args, world)
    if errors:
        raise FlagError("\n".join(errors))
    dp = world // (args.pp * args.sp * args.tp)
    ds_plan = None
    if args.deepspeed is not None:
        ds_plan, args = _read_deepspeed(args, dp, notices)
        errors = check_batch_split(args, dp)
        if ds_plan.sp_size != args.sp:
            errors.append(f"--deepspeed {args.deepspeed}: sequence_parallel_size is {ds_plan.sp_size} but --sp is "
                          f"{args.sp}; give --sp {ds_plan.sp_size} (it sets how the processes split)")
        if ds_plan.tp != args.tp:
            errors.append(f"--deepspeed {args.deepspeed}: tensor_parallel.autotp_size is {ds_plan.tp} but --tp is "
                          f"{args.tp}; give --tp {ds_plan.tp} (it sets how the processes split)")
        if errors:
            raise FlagError("\n".join(errors))
    split = args.microbatches if args.pp > 1 else args.accum
    fields = dict(dp=dp, pp=args.pp, zero_stage=args.zero, units=units, offload_optimizer=args.offload_optimizer,
                  offload_params=args.offload_params, nvme_path=args.nvme_path, remat=args.remat,
                  remat_offload=args.remat_offload, tile_lm_head=args.tile_lm_head, sp_size=args.sp,
                  sp_kind=args.sp_kind, tile_mlp=args.tile_mlp, tp=args.tp, sp=args.tp_sequence_parallel,
                  microbatches=args.microbatches,
                  pipeline_schedule=args.schedule, virtual_stages=args.virtual_stages,
                  precision=args.precision, accum=args.accum, gradient_clipping=args.grad_clip,
                  micro_batch=args.batch_size // (dp * split), global_batch=args.batch_size)
    if args.quantize_weights or args.quantize_grads:  # else a --deepspeed config's ZeRO++ keys stand
        fields.update(quantized_weights=args.quantize_weights, quantized_grads=args.quantize_grads)
    try:
        if ds_plan is None:
            plan = zf.config.Plan(**fields, optimizer=None)  # the recipe brings its own optimizer
        else:  # the config's optimizer, scheduler and fp16 scaling; the flags' layout
            plan = dataclasses.replace(ds_plan, **fields)
        zf.config.check(plan)
    except ValueError as e:
        raise FlagError(name_flags(str(e))) from None
    return plan, args


def name_flags(message: str) -> str:
    """A plan error "field: why" as "--flag (plan field): why"."""
    field, sep, why = message.partition(": ")
    if sep and field in FLAG_OF_FIELD:
        return f"{FLAG_OF_FIELD[field]} (plan {field}): {why}"
    return message


def engine_stage(plan: Any) -> int:
    """The ZeRO stage of the engine ``zf.parallelize`` runs for ``plan``: its ``zero_stage``, except
    an offloaded plain step (one process, stage 0), which ``zf.offload`` runs on a one-process
    stage 2 (stage 3 with the params offloaded)."""
    if plan.zero_stage == 0 and plan.dp == 1 and plan.offload_optimizer != "none":
        return 3 if plan.offload_params != "none" else 2
    return plan.zero_stage


def rank0_params(model: Any, params: dict, plan: Any) -> dict:
    """The params whose states rank 0 keeps: all of them, or with ``--pp`` those pipeline stage 0
    owns (its units and the shared ones, as ``zf.pipeline`` lays them out). Raises FlagError naming
    --pp when the model has fewer pipeline units than stages."""
    if plan.pp == 1:
        return params
    import zfunc as zf
    from zfunc.pipelining.step import make_layout

    units = zf.config.selector(plan.units) if plan.units is not None else zf.units.auto()
    try:
        owner = make_layout(model, units, plan.pp * plan.virtual_stages, None).owner
    except ValueError as e:
        raise FlagError(f"--pp: {e}") from None
    return {name: p for name, p in params.items() if owner.get(name, 0) % plan.pp == 0}  # stage k on rank k % pp


# ----------------------------------------------------------------------------- --deepspeed


def _auto_name(path: str) -> str | None:
    """The Hugging Face name of the value an "auto" at ``path`` takes (zf.config.from_deepspeed's
    auto names), or None where "auto" is a tuning knob's."""
    from zfunc.config.deepspeed_keys import AUTO_NAMES

    *parents, key = path.split(".")
    if key == "enabled" and parents:
        key = {"bfloat16": "bf16"}.get(parents[-1], parents[-1])
    elif key == "warmup_max_lr":
        key = "lr"
    return key if key in AUTO_NAMES else None


def _autos(config: Any, path: str = "") -> set[str]:
    if isinstance(config, dict):
        return set().union(*(_autos(v, f"{path}.{k}" if path else str(k)) for k, v in config.items()))
    name = _auto_name(path) if config == "auto" else None
    return {name} if name else set()


def _flag_values(args: argparse.Namespace, dp: int, config: dict) -> dict[str, Any]:
    """The recipe's values for DeepSpeed's "auto" names (the Hugging Face Trainer's set)."""
    split = args.microbatches if args.pp > 1 else args.accum  # DeepSpeed's pipeline: accumulation = microbatches
    values = dict(train_batch_size=args.batch_size, gradient_accumulation_steps=split,
                  gradient_clipping=args.grad_clip, lr=args.lr, betas=[0.9, 0.95], eps=1e-8,
                  weight_decay=args.weight_decay, warmup_num_steps=max(1, args.warmup),
                  total_num_steps=getattr(args, "schedule_steps", None) or args.steps,
                  fp16=args.precision == "fp16", bf16=args.precision == "bf16")
    # --batch-size is the global batch: with train_batch_size in the config, DeepSpeed's batch rule
    # works out the micro batch from it and the accumulation (the config's own, if it sets one)
    if "train_batch_size" not in config:
        accum = config.get("gradient_accumulation_steps")
        accum = accum if isinstance(accum, int) and not isinstance(accum, bool) and accum >= 1 else split
        if args.batch_size % (dp * accum) == 0:
            values["train_micro_batch_size_per_gpu"] = args.batch_size // (dp * accum)
    return values


def _batch_from_flags(args: argparse.Namespace, dp: int, config: dict) -> tuple[dict, str]:
    """``(config, what was filled)``: a config that gives neither train_batch_size nor
    train_micro_batch_size_per_gpu (Hugging Face's leave them to the Trainer) takes the batch from
    --batch-size, and its accumulation, where it gives none, from --accum (--microbatches with
    --pp), as if they said "auto"; a config that gives a size is unchanged ("")."""
    if "train_batch_size" in config or "train_micro_batch_size_per_gpu" in config:
        return config, ""
    name = "microbatches" if args.pp > 1 else "accum"
    filled = f"train_batch_size is --batch-size {args.batch_size}"
    accum = config.get("gradient_accumulation_steps", "auto")
    if "gradient_accumulation_steps" not in config:
        filled += f" and gradient_accumulation_steps is {flag(name)} {getattr(args, name)}"
    split = getattr(args, name) if accum == "auto" else accum
    if isinstance(split, int) and not isinstance(split, bool) and split >= 1:  # else the reader names it
        errors = check_batch_split(argparse.Namespace(**{**vars(args), name: split}), dp)
        if errors:
            where = "" if accum == "auto" else f" (gradient_accumulation_steps = {accum} in {args.deepspeed})"
            raise FlagError(errors[0] + where)
    return {**config, "train_batch_size": "auto", "gradient_accumulation_steps": accum}, filled


# flag -> (where the DeepSpeed config says it, the plan's value of it)
_CONTRADICTIONS = dict(
    zero=("zero_optimization.stage", lambda p: p.zero_stage),
    offload_optimizer=("zero_optimization.offload_optimizer.device", lambda p: p.offload_optimizer),
    offload_params=("zero_optimization.offload_param.device", lambda p: p.offload_params),
    nvme_path=("zero_optimization.offload_*.nvme_path", lambda p: p.nvme_path),
    precision=("fp16.enabled / bf16.enabled", lambda p: p.precision),
    batch_size=("train_batch_size", lambda p: p.global_batch),
    accum=("gradient_accumulation_steps", lambda p: p.accum),
    microbatches=("gradient_accumulation_steps (a pipeline's microbatches)", lambda p: p.accum),
    grad_clip=("gradient_clipping", lambda p: p.gradient_clipping),
    lr=("optimizer.params.lr", lambda p: p.optimizer_params.get("lr")),
    weight_decay=("optimizer.params.weight_decay", lambda p: p.optimizer_params.get("weight_decay")),
    warmup=("scheduler.params.warmup_num_steps", lambda p: p.scheduler_params.get("warmup_num_steps")),
)


def _read_deepspeed(args: argparse.Namespace, dp: int, notices: bool) -> tuple[Any, argparse.Namespace]:
    """The config's plan, and ``args`` with its values; a given flag that differs is an error."""
    import zfunc as zf
    from zfunc.config import deepspeed as deepspeed_config

    path = args.deepspeed
    try:
        config = deepspeed_config.load(path)
    except (OSError, ValueError) as e:
        raise FlagError(f"--deepspeed {path}: {e}") from None
    config, filled = _batch_from_flags(args, dp, config)
    if filled and notices:
        print(f"--deepspeed {path}: the config gives no batch size, so {filled}")
    values = _flag_values(args, dp, config)
    given = getattr(args, "given", frozenset())
    # "auto" takes the flags' values; an explicit value wins over a flag left at its default
    auto = {name: values[name] for name in _autos(config) if name in values}
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always", zf.config.IgnoredKeysWarning)
        try:
            plan = zf.config.from_deepspeed(config, world_size=dp, **auto)
        except (ValueError, TypeError) as e:
            hint = (" (its 'auto' values come from --batch-size, --accum or --microbatches, --grad-clip, --lr, "
                    "--weight-decay, --warmup, --steps and --precision)") if "auto value" in str(e) else ""
            raise FlagError(f"--deepspeed {path}: {e}{hint}") from None
    for notice in told:  # the reader's notice as one line, without the warning machinery's file and line
        if not issubclass(notice.category, zf.config.IgnoredKeysWarning):
            warnings.warn_explicit(notice.message, notice.category, notice.filename, notice.lineno)
        elif notices:
            print(f"--deepspeed {path}: {notice.message}")
    errors = []
    not_here = "microbatches" if args.pp == 1 else "accum"  # the config's accumulation is the other one
    for name, (key, value_of) in _CONTRADICTIONS.items():
        if name not in given or name == not_here:
            continue
        planned = value_of(plan)  # None: the config does not say (no optimizer, no scheduler)
        mine = max(1, args.warmup) if name == "warmup" else getattr(args, name)  # DeepSpeed's least warmup: 1
        if planned is not None and planned != mine:
            errors.append(f"{flag(name)} {getattr(args, name)!r} contradicts {key} = {planned!r} in --deepspeed {path}")
    if errors:
        raise FlagError("\n".join(errors))
    merged = dict(zero=plan.zero_stage, offload_optimizer=plan.offload_optimizer, offload_params=plan.offload_params,
                  nvme_path=plan.nvme_path, precision=plan.precision, batch_size=plan.global_batch,
                  grad_clip=plan.gradient_clipping, remat=args.remat or plan.remat,
                  remat_offload=args.remat_offload or plan.remat_offload)
    merged["microbatches" if args.pp > 1 else "accum"] = plan.accum
    return plan, argparse.Namespace(**{**vars(args), **merged})


def deepspeed_optimizer(plan: Any) -> dict | None:
    """The optimizer and scheduler a DeepSpeed config chose (saved with the flags), None if none."""
    if plan.optimizer is None and plan.scheduler is None:
        return None
    return dict(optimizer=plan.optimizer, optimizer_params=plan.optimizer_params, scheduler=plan.scheduler,
                scheduler_params=plan.scheduler_params)


# ----------------------------------------------------------------------------- the state, whole


def whole_params(state: Any, mesh: Any) -> dict[str, torch.Tensor]:
    """Every param whole, on every rank, from a state of any layout (a collective when sharded
    or pipelined: every rank calls it). Costs the whole model in fp32 on each rank."""
    import zfunc as zf

    if state.placement is None:
        return state.params
    return zf.checkpoint.full_params(state, mesh)
