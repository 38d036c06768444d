"""What a recipe prints before it trains and leaves behind after: --help states each default once,
the plan line counts the ranks and bytes of rank 0's share (a pipeline's stage, ZeRO's shard, and
why ZeRO 1/2 on one process holds more than ZeRO 0), a model vocabulary wider than the data's is
named with its cost, and a clean run's NVMe swap files are removed unless --keep-swap."""
import argparse
import re

import pytest

from recipes import bert, cli, gpt, layout, llama, report
from tests.recipe_runs import TINY

RECIPES = {"gpt": gpt.RECIPE, "llama": llama.RECIPE, "bert": bert.RECIPE}


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize("recipe", RECIPES)
def test_help_states_each_options_default_at_most_once(recipe):
    parser = cli.parser(RECIPES[recipe])
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action)
        assert len(re.findall(r"\bdefault\b", text)) <= 1, (action.option_strings, text)
        assert "(default: None)" not in text, (action.option_strings, text)
    steps = next(a for a in parser._actions if "--steps" in a.option_strings)
    assert formatter._expand_help(steps) == f"(default: {RECIPES[recipe].defaults['steps']})"  # still stated


# ----------------------------------------------------------------------------- swap files
def test_a_clean_run_removes_its_swap_files_and_keep_swap_keeps_them(tmp_path, text_file, capsys):
    run = TINY + ["--steps", "1", "--eval-batches", "1", "--sample-len", "1", "--data", str(text_file),
                  "--offload-optimizer", "nvme"]
    (tmp_path / "given").mkdir()
    gpt.main(run + ["--nvme-path", str(tmp_path / "given"), "--out", str(tmp_path / "a")])
    assert list((tmp_path / "given").iterdir()) == []  # a folder zfunc did not make stays, empty
    assert "removed the swap files" in capsys.readouterr().out
    gpt.main(run + ["--nvme-path", str(tmp_path / "made"), "--out", str(tmp_path / "b"), "--keep-swap"])
    kept = [p.name for p in (tmp_path / "made").iterdir()]
    assert any(n.endswith(".swap") for n in kept) and any(n.endswith(".spare") for n in kept)
    assert "removed the swap files" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- the plan line
def described(argv: list[str], world: int = 1, recipe=gpt, line: int = -1):
    """``(plan line, plan_bytes, meta params, model)`` of ``argv`` as rank 0 of ``world`` would say them
    (``line``: another of ``report.describe``'s lines in place of the plan's)."""
    import torch

    import zfunc as zf

    pinned = [] if "--precision" in argv else ["--precision", "fp32"]  # the default depends on the CPU
    args = cli.parse_args(recipe.RECIPE, TINY + pinned + argv)
    plan, args = layout.resolve(cli.with_precision(args), world, recipe.RECIPE.units)
    with torch.device("meta"):
        built = recipe.RECIPE.build(args, 256)
    zf.config.prepare(built.module, plan)
    _, params = zf.functionalize(built.module)
    lines = report.describe(args, plan, layout.Launch(world, 0, 0), built, torch.device("cpu"), params)
    return lines[line], report.plan_bytes(params, plan, built.module), params, built.module


@pytest.mark.parametrize("flags, said", [
    ([], "dp=1 pp=1, ZeRO 0"),
    (["--pp", "2", "--microbatches", "2"], "dp=1 pp=2 (1f1b schedule), ZeRO 0"),
    (["--pp", "2", "--microbatches", "4", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"],
     "dp=1 pp=2 (interleaved-1f1b schedule, 2 virtual stages per rank), ZeRO 0"),
])
def test_the_layout_line_names_the_pipeline_schedule(flags, said):
    world = 2 if flags else 1
    line, _, _, _ = described(["--n-layer", "4"] + flags, world=world, line=-2)
    assert f"layout: {world} process{'es' * (world > 1)}, {said}" in line, line


def test_a_pipelines_plan_line_counts_its_ranks_and_stage_0s_bytes():
    import zfunc as zf
    from zfunc import plan as zp
    from zfunc.pipelining.step import make_layout

    line, where, params, model = described(["--n-layer", "2", "--pp", "2", "--microbatches", "2"], world=2)
    owner = make_layout(model, zf.units.by_class(gpt.Block), 2, None).owner
    stage0 = [tuple(p.shape) for name, p in params.items() if owner[name] == 0]
    assert "rank 0 of 2, pipeline stage 0 of 2" in line, line
    whole = 16 * sum(p.numel() for p in params.values())  # fp32 masters, Adam's moments and grads
    assert where["device"] == sum(zp.engine_bytes(stage0, 1, 0, 0).values()) < whole
    line, where, _, _ = described(["--n-layer", "2", "--pp", "2", "--microbatches", "2", "--zero", "1"], world=4)
    assert "rank 0 of 4, pipeline stage 0 of 2" in line, line  # dp=2 per stage: stage 0's rows of rank 0
    assert where["device"] == sum(zp.engine_bytes(stage0, 2, 0, 1, accum=2).values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_1_and_2_on_one_process_say_what_they_hold_beyond_zero_0(precision):
    zero0, bytes0, _, _ = described(["--precision", precision])
    assert "ZeRO" not in zero0.partition("GB")[2], zero0
    for stage in ("1", "2"):
        line, where, _, _ = described(["--precision", precision, "--zero", stage])
        extra = where["device"] - bytes0["device"]
        assert extra > 0 and f"ZeRO {stage} on one process shards nothing" in line, line
        assert f"{extra / 1e9:.3g} GB more than --zero 0" in line, line
        assert ("a whole copy of the params" in line) == (precision == "fp32"), line  # bf16: ZeRO 0 has one too


def test_an_offloaded_plain_step_is_accounted_as_the_stage_2_it_runs_on():
    zero0, bytes0, _, _ = described(["--offload-optimizer", "cpu"])
    zero2, bytes2, _, _ = described(["--offload-optimizer", "cpu", "--zero", "2"])  # zf.offload's engine, named
    assert bytes0 == bytes2 and "shards nothing" not in zero2, zero2


# ----------------------------------------------------------------------------- the vocabulary line
def dry_run(recipe, argv, text_file, tmp_path, capsys) -> list[str]:
    """The vocabulary lines a dry run of ``argv`` prints (32-byte windows, the recipe's model otherwise)."""
    recipe.main(["--block-size", "32", "--batch-size", "8", "--data", str(text_file), "--dry-run",
                 "--out", str(tmp_path / "out"), *argv])
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("vocab:")]


def test_an_hf_config_wider_than_the_bytes_is_named_with_its_cost_and_the_fix(tmp_path, text_file, capsys):
    pytest.importorskip("transformers")
    import json

    config = dict(model_type="gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=50257)
    said = dry_run(gpt, ["--hf-config", json.dumps(config)], text_file, tmp_path, capsys)
    rows = 50257 * 32  # the tied embedding and head
    assert len(said) == 1, said
    assert "50,257 token ids" in said[0] and "the data 256 (bytes)" in said[0], said
    assert f"{rows / 1e6:.2f}M params" in said[0] and f"{16 * rows / 1e9:.3g} GB" in said[0], said
    assert '"vocab_size": 256 in the --hf-config shrinks them' in said[0], said
    assert dry_run(gpt, ["--hf-config", json.dumps({**config, "vocab_size": 256})], text_file, tmp_path, capsys) == []


def test_a_flavor_wider_than_the_bytes_is_named_and_the_recipes_own_model_is_not(tmp_path, text_file, capsys):
    said = dry_run(llama, ["--flavor", "125M"], text_file, tmp_path, capsys)
    assert len(said) == 1 and "49,152 token ids" in said[0] and "--flavor 125M" in said[0], said
    assert dry_run(llama, [], text_file, tmp_path, capsys) == []
    assert dry_run(bert, [], text_file, tmp_path, capsys) == []  # 256 bytes + its 4 special tokens: all used
