"""``python -m zfunc.plan``: the estimate of one plan, a search, calibration, validation, the papers.

    python -m zfunc.plan --params 7e9 --gpu A100-80GB --gpus 16 --zero 3 --micro-batch 4 --seq 2048
    python -m zfunc.plan --hf-config llama.json --gpus 64 --search
    python -m recipes.plan --flavor 7B --recipe llama --gpus 8 --json   # a recipe's size: the recipes register them
    python -m zfunc.plan --calibrate [--calibration PATH]      # measure this machine
    python -m zfunc.plan --validate                            # predicted vs measured benchmarks, here
    python -m zfunc.plan --papers                              # the published headline runs, predicted
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import replace

from zfunc.config import json_file
from zfunc.plan import core, hardware, model as model_mod
from zfunc.plan.search import search as search_plans
from zfunc.config.plan import Plan
from zfunc.plan.strategy import PLACES, PRECISIONS, REMATS, SCHEDULES, OPTIMIZER_STATE_BYTES, describe, from_flags

GB = 1e9


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zfunc.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("model (one of)")
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (a standard shape)")
    what.add_argument("--flavor", help="a registered recipe's named size (zfunc.plan.register_flavors; "
                      "python -m recipes.plan registers the recipes')")
    what.add_argument("--recipe", default="gpt", help="the recipe --flavor belongs to (default gpt)")
    what.add_argument("--hf-config", help="a transformers config: JSON file or JSON text")
    what.add_argument("--layers", type=int, help="explicit shape: layers (with --hidden, --heads)")
    what.add_argument("--hidden", type=int)
    what.add_argument("--heads", type=int)
    what.add_argument("--kv-heads", type=int)
    what.add_argument("--ffn", type=int)
    what.add_argument("--vocab", type=int, default=50257)
    what.add_argument("--kind", choices=model_mod.KINDS, default="gpt")
    hw = p.add_argument_group("cluster")
    hw.add_argument("--gpu", default="H100-80GB", help=f"one of {', '.join(hardware.GPUS)} (default H100-80GB)")
    hw.add_argument("--gpus", type=int, default=8)
    hw.add_argument("--gpus-per-node", type=int)
    for flag, unit in (("intra-bw", "GB/s per GPU, one way"), ("inter-bw", "GB/s per node, one way"),
                       ("pcie-bw", "GB/s per GPU"), ("cpu-ram", "GB per node"), ("cpu-mem-bw", "GB/s per node"),
                       ("nvme", "GB per node"), ("nvme-read-bw", "GB/s per node"), ("nvme-write-bw", "GB/s per node")):
        hw.add_argument(f"--{flag}", type=float, help=unit)
    hw.add_argument("--matmul-efficiency", type=float, help="fraction of the datasheet peak a large GEMM reaches")
    hw.add_argument("--link", action="append", default=[], metavar="AXIS=GB/s",
                    help="a mesh axis's link, GB/s one rank moves (dp, pp, sp or tp; repeatable): --link dp=0.125 "
                         "is 1 Gbit/s Ethernet between the data-parallel ranks")
    hw.add_argument("--calibration", help="use this machine's calibrated constants (a --calibrate JSON file)")
    st = p.add_argument_group("strategy")
    for flag in ("dp", "pp", "tp"):
        st.add_argument(f"--{flag}", type=int)
    st.add_argument("--sp", action="store_true", help="Megatron's sequence parallelism (with --tp)")
    st.add_argument("--sp-size", type=int, default=1, help="zf.sequence_parallel's ranks per sequence (default 1)")
    st.add_argument("--sp-kind", default="ulysses", help="ulysses or ring (with --sp-size)")
    st.add_argument("--zero", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    st.add_argument("--offload-optimizer", default="none", help=f"one of {PLACES}")
    st.add_argument("--offload-params", default="none", help=f"one of {PLACES}")
    st.add_argument("--remat", nargs="?", const="full", default="none", help=f"one of {REMATS} (alone: full)")
    st.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per microbatch")
    st.add_argument("--accum", type=int, default=1, help="microbatches per step (a pipeline's microbatches)")
    st.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    st.add_argument("--precision", help=f"one of {PRECISIONS} (default bf16; fp16 where there is no bf16)")
    st.add_argument("--optimizer", default="adamw", help=f"one of {sorted(OPTIMIZER_STATE_BYTES)}")
    st.add_argument("--quantize-weights", action="store_true", help="ZeRO++ (--zero 3): params gathered in int8")
    st.add_argument("--quantize-grads", type=int, choices=(0, 4, 8), default=0,
                    help="ZeRO++ (--zero 1-3): grads reduce-scattered in 4 or 8 bits (0: fp32)")
    st.add_argument("--no-clip", action="store_true", help="no global-norm clip (offload may update in backward)")
    st.add_argument("--tiles", type=int, default=1, help="zf.tile on the largest Linears")
    st.add_argument("--schedule", default="1f1b", help=f"one of {SCHEDULES}")
    st.add_argument("--virtual-stages", type=int, default=1, help="virtual pipeline stages per rank (interleaved-1f1b)")
    out = p.add_argument_group("what to do")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--search", action="store_true", help="the fastest strategies that fit")
    out.add_argument("--top", type=int, default=5)
    out.add_argument("--global-batch", type=int, help="--search: sequences per step, kept fixed")
    out.add_argument("--allow-tp", action="store_true", help="--search: include tensor parallelism (modelled only)")
    out.add_argument("--calibrate", action="store_true", help="measure this machine into --calibration's file")
    out.add_argument("--validate", action="store_true", help="predicted vs measured benchmarks on this machine")
    out.add_argument("--papers", action="store_true", help="the published headline runs beside their predictions")
    return p


# flag -> (holds for a value given, what is expected); a flag left out (None) is not checked
_COUNT = (lambda v: v >= 1, "an int >= 1")
_POSITIVE = (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
NUMBER_FLAGS = {
    **{name: _COUNT for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gpus", "gpus_per_node",
                                 "dp", "pp", "tp", "sp_size", "micro_batch", "accum", "seq", "tiles", "top",
                                 "global_batch")},
    **{name: _POSITIVE for name in ("intra_bw", "inter_bw", "pcie_bw", "cpu_ram", "cpu_mem_bw", "nvme_read_bw",
                                    "nvme_write_bw")},
    "params": (lambda v: math.isfinite(v) and v >= 1, "a finite count >= 1"),
    "nvme": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0: no NVMe)"),
    "matmul_efficiency": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
}
# The cluster flags are in GB and GB/s: a value beyond any machine (1 PB per node, 100 TB/s) was given in bytes
_MOST_GB = {"cpu_ram": 1e6, "nvme": 1e6, **dict.fromkeys(("intra_bw", "inter_bw", "pcie_bw", "cpu_mem_bw",
                                                              "nvme_read_bw", "nvme_write_bw"), 1e5)}


def check_numbers(args, p: argparse.ArgumentParser) -> None:
    """Every number flag given in its range (argparse checks only that it parses: 'nan' is a float),
    and an explicit shape's heads fitting its width; ``p.error`` names the flag, value and range."""
    for name, (ok, expected) in NUMBER_FLAGS.items():
        value = getattr(args, name)
        if value is not None and not ok(value):
            p.error(f"--{name.replace('_', '-')}: expected {expected}, got {value!r}")
    for name, most in _MOST_GB.items():
        value = getattr(args, name)
        if value is not None and value > most:
            unit = "GB" if name in ("cpu_ram", "nvme") else "GB/s"
            flag = f"--{name.replace('_', '-')}"
            p.error(f"{flag}: expected {unit} (at most {most:g}), got {value:g}, which looks like bytes: "
                    f"{flag} {value / 1e9:g} is {value:g} bytes{'/s' if unit == 'GB/s' else ''}")
    if args.layers is not None and args.hidden is not None and args.heads is not None and args.hidden % args.heads:
        p.error(f"--heads: expected a divisor of --hidden {args.hidden}, got {args.heads}")
    if args.kv_heads is not None and args.heads is not None and args.heads % args.kv_heads:
        p.error(f"--kv-heads: expected a divisor of --heads {args.heads}, got {args.kv_heads}")


def build_model(args, p: argparse.ArgumentParser) -> model_mod.ModelSpec:
    given = [f for f in ("params", "flavor", "hf_config", "layers") if getattr(args, f) is not None]
    if len(given) != 1:
        p.error(f"--params, --flavor, --hf-config, --layers: give exactly one model, got {given or 'none'}")
    try:
        if args.params is not None:
            return model_mod.from_params(args.params, kind=args.kind, vocab=args.vocab)
        if args.flavor is not None:
            return model_mod.from_flavor(args.flavor, args.recipe)
        if args.hf_config is not None:
            return model_mod.from_hf_config(checked_hf_config(args.hf_config, p))
        if args.hidden is None or args.heads is None:
            p.error("--layers: an explicit shape needs --hidden and --heads too")
        return model_mod.from_shape(args.layers, args.hidden, args.heads, kind=args.kind, vocab=args.vocab,
                                    ffn=args.ffn, kv_heads=args.kv_heads)
    except ValueError as e:
        p.error(_flagged(e))


def checked_hf_config(spec: str, p: argparse.ArgumentParser) -> dict:
    """--hf-config read and checked as the recipes check it (``zfunc.config.hf``: bounded JSON, every
    value in range, nothing that runs code), as a dict."""
    from zfunc.config import hf as hf_config

    try:
        cfg = hf_config.read(spec)
        hf_config.checked(cfg, hf_config.where(spec))
    except (OSError, ValueError, ImportError) as e:
        p.error(f"--hf-config: {e}")
    return cfg


def build_cluster(args, p: argparse.ArgumentParser) -> hardware.Cluster:
    if args.calibration:
        from zfunc.plan import calibrate

        try:
            if not isinstance(json_file.read(args.calibration), dict):  # its bounds first: load trusts the file
                raise ValueError("expected a JSON object written by python -m zfunc.plan --calibrate")
            return calibrate.cluster_from(calibrate.load(args.calibration), args.gpus)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--calibration: {args.calibration}: {e}")
    if args.gpu not in hardware.GPUS:
        p.error(f"--gpu: expected one of {', '.join(hardware.GPUS)}, got {args.gpu!r}")
    scaled = {"intra_bw": args.intra_bw, "inter_bw": args.inter_bw, "pcie_bw": args.pcie_bw, "cpu_ram": args.cpu_ram,
              "cpu_mem_bw": args.cpu_mem_bw, "nvme_bytes": args.nvme, "nvme_read_bw": args.nvme_read_bw,
              "nvme_write_bw": args.nvme_write_bw}
    overrides = {k: v * GB for k, v in scaled.items() if v is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.matmul_efficiency is not None:
        overrides["matmul_efficiency"] = args.matmul_efficiency
    if args.link:
        overrides["links"] = _links(p, args.link)
    try:
        return hardware.cluster(args.gpu, args.gpus, **overrides)
    except ValueError as e:
        p.error(_flagged(e))


def _links(p: argparse.ArgumentParser, given: list[str]) -> dict[str, float]:
    """``--link AXIS=GB/s`` flags as ``Cluster.links`` (bytes/s)."""
    links = {}
    for text in given:
        axis, _, value = text.partition("=")
        try:
            gbps = float(value)
        except ValueError:
            gbps = math.nan
        if axis not in hardware.AXES or not gbps > 0 or math.isinf(gbps):
            p.error(f"--link: expected AXIS=GB/s with AXIS one of {', '.join(hardware.AXES)} and GB/s a number > 0, "
                    f"such as dp=0.125, got {text!r}")
        links[axis] = gbps * GB
    return links


def build_plan(args, device: hardware.Device) -> Plan:
    """The ``zf.config.Plan`` the strategy flags ask for (``zfunc.plan.strategy.from_flags``)."""
    precision = args.precision or ("bf16" if device.peak.get("bf16") else "fp16" if device.peak.get("fp16") else "fp32")
    return from_flags(dp=args.dp, pp=args.pp or 1, tp=args.tp or 1, sp=args.sp, zero=args.zero,
                      offload_optimizer=args.offload_optimizer, offload_params=args.offload_params, remat=args.remat,
                      micro_batch=args.micro_batch, accum=args.accum, seq=args.seq, precision=precision,
                      optimizer=args.optimizer, clip=not args.no_clip, tiles=args.tiles, schedule=args.schedule,
                      virtual_stages=args.virtual_stages, sp_size=args.sp_size, sp_kind=args.sp_kind)


def with_quantized(run: Plan, args) -> Plan:
    """``run`` with ZeRO++'s quantized collectives of --quantize-weights / --quantize-grads."""
    if not (args.quantize_weights or args.quantize_grads):
        return run
    try:
        return replace(run, quantized_weights=args.quantize_weights, quantized_grads=args.quantize_grads)
    except ValueError as e:  # named as the flag: quantized_weights -> --quantize-weights
        raise ValueError(str(e).replace("quantized_", "quantize_", 1)) from None


def _flagged(e: Exception) -> str:
    """An error naming an argument of ``from_flags`` (``zero: ...``) as its flag (``--zero: ...``)."""
    text = str(e)
    m = re.match(r"([a-z_]+(?:, [a-z_]+)*): ", text)
    if not m:
        return text
    flags = ", ".join("--" + f.replace("_", "-") for f in m.group(1).split(", "))
    return flags + text[len(m.group(1)):]


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.calibrate:
        from zfunc.plan import calibrate

        path = calibrate.save(calibrate.measure(), args.calibration)
        print(f"wrote {path}")
        return 0
    if args.validate:
        from zfunc.plan import validate

        return validate.main(args.calibration)
    if args.papers:
        from zfunc.plan import papers

        print(papers.table())
        return 0
    check_numbers(args, p)
    model = build_model(args, p)
    cluster = build_cluster(args, p)
    try:
        run = with_quantized(build_plan(args, cluster.device), args)
        if args.search:
            found = search_plans(model, cluster, run, global_batch=args.global_batch,
                                      allow_tp=args.allow_tp, top=args.top)
            if args.json:
                print(json.dumps([f.to_json() for f in found], indent=1))
            elif not found:
                print("no strategy fits")
            for rank, f in enumerate(found if not args.json else []):
                print(f"{rank + 1}. {describe(f.plan)}: {f.tokens_per_step / f.step_time:,.0f} tokens/s, "
                      f"{f.tflops_per_gpu:.1f} TFLOP/s per GPU, {f.gpu_bytes / GB:.1f} GB per GPU")
            return 0 if found else 1
        result = core.plan(model, cluster, run)
    except ValueError as e:
        p.error(_flagged(e))
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
