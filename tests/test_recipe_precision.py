"""recipes/precision.py: each recipe's default precision fits the machine (bf16 on CUDA and on a CPU
with native bf16 units, fp32 elsewhere, BERT included), its first line says what it picked and why,
and a bf16/fp16 this CPU emulates -- asked by --precision or by a --deepspeed config -- is warned
about once, with the measured slowdown. The CPU's flags are injected."""
import argparse
import json

import pytest

from recipes import bert, cli, gpt, llama
from recipes import precision as rp
from zfunc.ops.cpu import units as cpu_units

AVX2 = frozenset({"avx2", "fma", "f16c"})  # no native half precision
ZEN4 = frozenset({"avx512f", "avx512_bf16"})  # bf16 dot products, no fp16
SAPPHIRE_RAPIDS = frozenset({"avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16"})
GRAVITON3 = frozenset({"asimd", "asimdhp", "bf16"})
RECIPES = {"gpt": gpt, "llama": llama, "bert": bert}


def args_of(*given, deepspeed=None):
    return argparse.Namespace(given=frozenset(given), deepspeed=deepspeed)


def test_the_default_is_bf16_on_cuda_and_on_a_cpu_with_native_bf16_else_fp32():
    assert rp.default("cuda", AVX2) == ("bf16", "default on CUDA")
    for flags, units in ((ZEN4, "avx512_bf16"), (SAPPHIRE_RAPIDS, "amx_bf16, avx512_bf16"), (GRAVITON3, "bf16")):
        assert rp.default("cpu", flags) == ("bf16", f"default: this CPU has native bf16 matrix units: {units}")
    precision, why = rp.default("cpu", AVX2)
    assert precision == "fp32"
    assert why == "default: this CPU has no native bf16 matrix units (AMX, AVX512-BF16, Arm BF16)"


def test_the_first_line_says_what_was_picked_and_why():
    assert rp.first_line(args_of(), "fp32", "cpu", AVX2) == (
        "precision fp32 (default: this CPU has no native bf16 matrix units (AMX, AVX512-BF16, Arm BF16))")
    assert rp.first_line(args_of(), "bf16", "cpu", ZEN4) == (
        "precision bf16 (default: this CPU has native bf16 matrix units: avx512_bf16)")
    assert rp.first_line(args_of("precision"), "fp16", "cpu", AVX2) == "precision fp16 (--precision)"
    assert rp.first_line(args_of(deepspeed="ds.json"), "fp16", "cpu", AVX2) == (
        "precision fp16 (fp16.enabled in --deepspeed ds.json)")
    # a config that agrees with the default is the default's doing
    assert rp.first_line(args_of(deepspeed="ds.json"), "fp32", "cpu", AVX2).startswith("precision fp32 (default: ")


def slower(precision):
    return "{}-{}x slower than fp32".format(*rp.EMULATED_SLOWDOWN[precision])


def test_a_half_precision_this_cpu_emulates_is_warned_about_with_the_measured_slowdown():
    fp16 = rp.emulation_warning(args_of("precision"), "fp16", "cpu", ZEN4)
    assert fp16 == ("warning: --precision fp16: this CPU has no native fp16 arithmetic, so it trains "
                    f"{slower('fp16')}; leave --precision out for this CPU's default")
    bf16 = rp.emulation_warning(args_of("precision"), "bf16", "cpu", AVX2)
    assert bf16.startswith("warning: --precision bf16: this CPU has no native bf16 arithmetic, so it trains "
                           f"{slower('bf16')}")
    ds = rp.emulation_warning(args_of(deepspeed="ds.json"), "fp16", "cpu", AVX2)
    assert ds.startswith("warning: fp16.enabled in --deepspeed ds.json: this CPU has no native fp16 arithmetic")
    assert ds.endswith('set it to false or "auto" for this CPU\'s default')
    # nothing to warn about: fp32, native units, a GPU
    assert rp.emulation_warning(args_of("precision"), "fp32", "cpu", AVX2) is None
    assert rp.emulation_warning(args_of("precision"), "bf16", "cpu", ZEN4) is None
    assert rp.emulation_warning(args_of("precision"), "fp16", "cpu", SAPPHIRE_RAPIDS) is None
    assert rp.emulation_warning(args_of("precision"), "fp16", "cuda", AVX2) is None


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("flags,want", [(AVX2, "fp32"), (ZEN4, "bf16")])
def test_every_recipe_bert_included_defaults_to_the_machines_precision(name, flags, want, monkeypatch):
    monkeypatch.setattr(cpu_units, "cpu_flags", lambda path=cpu_units.CPUINFO: flags)
    args = cli.parse_args(RECIPES[name].RECIPE, ["--device", "cpu"])
    assert cli.with_precision(args).precision == want


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 200)
    return path


TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
        "--device", "cpu", "--dry-run"]


def run(capsys, monkeypatch, flags, argv):
    monkeypatch.setattr(cpu_units, "cpu_flags", lambda path=cpu_units.CPUINFO: flags)
    gpt.main(TINY + argv)
    return capsys.readouterr()


def test_the_recipe_says_its_precision_on_its_first_line(tmp_path, text_file, capsys, monkeypatch):
    said = run(capsys, monkeypatch, AVX2, ["--data", str(text_file), "--out", str(tmp_path / "out")])
    first = said.out.splitlines()[0]
    assert first == rp.first_line(args_of(), "fp32", "cpu", AVX2) and "warning" not in said.err
    assert "precision fp32" in said.out.splitlines()[2]  # the model line agrees


def test_an_emulated_precision_asked_for_warns_once_on_stderr(tmp_path, text_file, capsys, monkeypatch):
    said = run(capsys, monkeypatch, ZEN4, ["--data", str(text_file), "--out", str(tmp_path / "out"),
                                           "--precision", "fp16"])
    assert said.out.splitlines()[0] == "precision fp16 (--precision)"
    assert said.err.splitlines() == [rp.emulation_warning(args_of("precision"), "fp16", "cpu", ZEN4)]


def test_a_deepspeed_config_enabling_fp16_on_a_cpu_warns_the_same(tmp_path, text_file, capsys, monkeypatch):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}))
    said = run(capsys, monkeypatch, AVX2, ["--data", str(text_file), "--out", str(tmp_path / "out"),
                                           "--deepspeed", str(config)])
    where = f"fp16.enabled in --deepspeed {config}"
    assert said.out.splitlines()[0] == f"precision fp16 ({where})"
    assert [line for line in said.err.splitlines() if "warning" in line] == [
        f"warning: {where}: this CPU has no native fp16 arithmetic, so it trains {slower('fp16')}; set it to false "
        "or \"auto\" for this CPU's default"]
