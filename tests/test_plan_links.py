"""zf.plan's link bandwidth per mesh axis (Cluster.links): it sets the axis's collective time, and with the
codec's cost it predicts when compression pays: on a slow dp link or a slow inter-node network, not on NVLink."""
from __future__ import annotations

import pytest

import zfunc as zf
from zfunc import plan as zp
from zfunc.plan import cost
from zfunc.plan.compression import uncompressed

MODEL = zp.from_params(1.3e9)
ONEBIT = zf.config.Plan(zero_stage=0, optimizer="onebit_adam", micro_batch=4, seq=1024, precision="bf16")
QGZ = zf.config.Plan(zero_stage=2, quantized_grads=4, micro_batch=4, seq=1024, precision="bf16")
ZPP = zf.config.Plan(zero_stage=3, quantized_grads=4, quantized_weights=True, micro_batch=4, seq=1024,
                     precision="bf16")
GBIT = 1.25e8  # 1 Gbit/s in bytes/s


def test_a_link_per_axis_sets_that_axis_collective_time():
    slow = zp.cluster("H100-80GB", gpus=8, links={"dp": GBIT})
    nbytes, n = 8e9, 8
    assert cost.collective_time(slow, "all_reduce", nbytes, n, axis="dp") == pytest.approx(
        slow.latency * (n - 1) + nbytes * (n - 1) / n / GBIT)
    # another axis, or none, keeps the node model: NVLink inside the node
    assert cost.collective_time(slow, "all_reduce", nbytes, n, axis="tp") == cost.collective_time(
        zp.cluster("H100-80GB", gpus=8), "all_reduce", nbytes, n)
    plain = zf.config.Plan(zero_stage=2, micro_batch=4, seq=1024, precision="bf16")
    fast_dp = zp.plan(MODEL, zp.cluster("H100-80GB", gpus=8), plain).time["dp_comm"]
    assert zp.plan(MODEL, slow, plain).time["dp_comm"] > 100 * fast_dp
    with pytest.raises(ValueError, match="links: expected .* got 'xp': 1"):
        zp.cluster("H100-80GB", gpus=8, links={"xp": 1})


@pytest.mark.parametrize("how", [ONEBIT, QGZ, ZPP], ids=["onebit_adam", "qgZ", "qwZ+qgZ"])
def test_compression_pays_on_a_slow_link_and_not_on_nvlink(how):
    on_nvlink = zp.compression_speedup(MODEL, zp.cluster("H100-80GB", gpus=8), how)
    on_ethernet = zp.compression_speedup(MODEL, zp.cluster("H100-80GB", gpus=8, links={"dp": GBIT}), how)
    # two nodes: the dp ring crosses the nodes' network; at 10 Gbit/s per node compression pays there too
    across_nodes = zp.compression_speedup(MODEL, zp.cluster("H100-80GB", gpus=16, inter_bw=10 * GBIT), how)
    assert on_nvlink < 1 < 2 < on_ethernet, (on_nvlink, on_ethernet)  # the codec costs more than NVLink saves
    assert across_nodes > 2
    est = zp.plan(MODEL, zp.cluster("H100-80GB", gpus=8), how)
    assert est.time["codec"] > 0
    assert "codec" not in zp.plan(MODEL, zp.cluster("H100-80GB", gpus=8), uncompressed(
        est.plan)).time


def test_the_cli_takes_a_link_per_axis(capsys):
    import json

    from zfunc.plan.__main__ import main

    def step(flags):
        assert main(["--params", "1.3e9", "--gpus", "8", "--zero", "2", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["time_s"]

    plain, slow = step([]), step(["--link", "dp=0.125"])
    assert slow["dp_comm"] > 100 * plain["dp_comm"]
    assert step(["--link", "dp=0.125", "--quantize-grads", "4"])["step"] < slow["step"] / 1.5  # compression pays
    for bad in ("dp", "dp=0", "dp=-1", "dp=nan", "dp=inf", "xp=1"):
        with pytest.raises(SystemExit):
            main(["--params", "1.3e9", "--link", bad])
        assert f"--link: expected AXIS=GB/s with AXIS one of dp, pp, sp, tp and GB/s a number > 0, such as dp=0.125, " \
               f"got '{bad}'" in capsys.readouterr().err
