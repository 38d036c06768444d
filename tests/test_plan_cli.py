"""python -m zfunc.plan: every number flag is checked (argparse only parses them), and --hf-config is
read and checked as the recipes read it; each error names the flag, the value and what was expected."""
import json
import re

import pytest

from zfunc.plan.__main__ import main


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--params", "nan"], "--params: expected a finite count >= 1, got nan"),
    (["--params", "inf"], "--params: expected a finite count >= 1, got inf"),
    (["--params", "1e9", "--top", "0", "--search"], "--top: expected an int >= 1, got 0"),
    (["--params", "1e9", "--gpus-per-node", "0"], "--gpus-per-node: expected an int >= 1, got 0"),
    (["--params", "1e9", "--gpus-per-node", "-4"], "--gpus-per-node: expected an int >= 1, got -4"),
    (["--params", "1e9", "--matmul-efficiency", "0"], "--matmul-efficiency: expected a fraction in (0, 1], got 0.0"),
    (["--params", "1e9", "--matmul-efficiency", "nan"], "--matmul-efficiency: expected a fraction in (0, 1], got nan"),
    (["--params", "1e9", "--intra-bw", "-1"], "--intra-bw: expected a finite number > 0, got -1.0"),
    (["--params", "1e9", "--cpu-ram", "inf"], "--cpu-ram: expected a finite number > 0, got inf"),
    (["--params", "1e9", "--nvme", "-1"], "--nvme: expected a finite number >= 0 (0: no NVMe), got -1.0"),
    (["--params", "1e9", "--cpu-ram", "1.5e12"],
     "--cpu-ram: expected GB (at most 1e+06), got 1.5e+12, which looks like bytes: --cpu-ram 1500 is 1.5e+12 bytes"),
    (["--params", "1e9", "--inter-bw", "1.25e8"],
     "--inter-bw: expected GB/s (at most 100000), got 1.25e+08, which looks like bytes: --inter-bw 0.125 is "
     "1.25e+08 bytes/s"),
    (["--params", "1e9", "--seq", "0"], "--seq: expected an int >= 1, got 0"),
    (["--params", "1e9", "--pp", "0"], "--pp: expected an int >= 1, got 0"),
    (["--params", "1e9", "--global-batch", "0", "--search"], "--global-batch: expected an int >= 1, got 0"),
    (["--layers", "2", "--hidden", "64", "--heads", "3"], "--heads: expected a divisor of --hidden 64, got 3"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "3"],
     "--kv-heads: expected a divisor of --heads 4, got 3"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "-1"], "--ffn: expected an int >= 1, got -1"),
])
def test_a_number_flag_out_of_range_is_refused_naming_it(capsys, flags, message):
    assert message in refused(capsys, flags)


def test_hf_config_is_checked_as_the_recipes_check_it(capsys, tmp_path):
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": -1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    err = refused(capsys, ["--hf-config", str(path)])
    assert f"--hf-config: num_hidden_layers: expected an int >= 1, got -1 (in {str(path)!r})" in err
    path.write_text(json.dumps(dict(cfg, num_hidden_layers=2, auto_map={"AutoModelForCausalLM": "evil.Model"})))
    assert "--hf-config: auto_map: a config from a file never runs code" in refused(capsys, ["--hf-config", str(path)])
    path.write_text('{"model_type": "llama", "a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert re.search(r"--hf-config: nested more than \d+ levels deep", refused(capsys, ["--hf-config", str(path)]))


@pytest.mark.parametrize("text, message", [
    ('{"version": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 32 levels deep"),
    ("[1, 2]", "expected a JSON object written by python -m zfunc.plan --calibrate"),
], ids=["deep", "a list"])
def test_a_calibration_file_out_of_bounds_is_refused_naming_it(capsys, tmp_path, text, message):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    assert f"--calibration: {path}: {message}" in refused(capsys, ["--params", "1e9", "--calibration", str(path)])


def test_the_library_readers_check_as_the_cli_does(tmp_path):
    """zf.plan's own readers, called without the CLI: the same bounds and checks."""
    from zfunc.plan import calibrate, model

    with pytest.raises(ValueError, match=r"n_layer: expected .*got -1"):
        model.from_hf_config({"model_type": "gpt2", "n_layer": -1})
    with pytest.raises(ValueError, match="auto_map"):
        model.from_hf_config({"model_type": "gpt2", "auto_map": {"AutoModel": "evil.Model"}})
    deep = tmp_path / "cal.json"
    deep.write_text("[" * 100 + "]" * 100)
    with pytest.raises(ValueError, match="nest"):
        calibrate.load(deep)


def _estimate(capsys, flags: list[str]) -> dict:
    assert main(["--params", "1.3e9", "--gpus", "16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_compression_flags_predict_fewer_bytes_and_less_dp_time(capsys):
    """A 1-bit --optimizer at --zero 0 sends ~1/32 of the fp32 grad all-reduce; ZeRO++ int8 params and int4
    grads ~1/3.9 and ~1/7.8 of stage 3's fp32 gathers and reduce-scatters; the dp time falls with them."""
    gb = lambda e: e["comm_gb_by_collective"]  # noqa: E731
    plain, onebit = _estimate(capsys, ["--zero", "0"]), _estimate(capsys, ["--zero", "0", "--optimizer", "onebit_adam"])
    assert gb(plain)["all_reduce"] / gb(onebit)["compressed_all_reduce"] >= 16 and gb(onebit)["all_reduce"] < 1e-3
    z3 = _estimate(capsys, ["--zero", "3", "--precision", "fp32"])
    zpp = _estimate(capsys, ["--zero", "3", "--precision", "fp32", "--quantize-weights", "--quantize-grads", "4"])
    assert gb(z3)["all_gather"] / gb(zpp)["quantized_all_gather"] >= 3.5
    assert gb(z3)["reduce_scatter"] / gb(zpp)["quantized_reduce_scatter"] >= 7
    for fp32, squeezed in ((plain, onebit), (z3, zpp)):
        assert squeezed["time_s"]["dp_comm"] < fp32["time_s"]["dp_comm"]
    assert "--quantize-weights: ZeRO++'s int8 param gathers are stage 3's" in refused(
        capsys, ["--params", "1.3e9", "--zero", "1", "--quantize-weights"])
