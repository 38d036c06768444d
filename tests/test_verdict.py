"""recipes/verdict.py: a dry run says whether the run fits the machine it runs on (RAM, free disk under
--nvme-path, one GPU's memory), what binds and by how much, and, when it does not fit, a layout that
zfunc.plan's search finds fitting this machine, as the recipe's command line; it creates nothing."""
import re
import shlex

import pytest

from recipes import cli, llama, verdict

GB = 10**9
# zfunc.plan's bytes of one process by place and component (Plan.memory)
MEMORY = {"gpu": {"grad_shard": 4 * GB, "activations": 1 * GB}, "cpu": {"optimizer": 8 * GB, "staging": GB // 5},
          "nvme": {"masters": 2 * GB}}


def machine(**kw) -> verdict.Machine:
    return verdict.Machine(**{**dict(ram_total=32 * GB, ram_available=20 * GB, disk_path="/scratch",
                                     disk_free=10 * GB), **kw})


def by_name(needs) -> dict:
    return {n.resource: n for n in needs}


def test_on_a_cpu_ram_holds_the_device_and_cpu_bytes_and_the_disk_twice_the_swap_bytes():
    needs = by_name(verdict.needs(MEMORY, "cpu", machine()))
    assert set(needs) == {"RAM", "disk"}
    assert needs["RAM"].need == pytest.approx(13.2 * GB) and needs["RAM"].have == 20 * GB
    assert needs["RAM"].parts == {"model states": 12 * GB, "activations": 1 * GB, "working memory": GB // 5}
    assert needs["disk"].need == 4 * GB and needs["disk"].have == 10 * GB  # each swap file keeps a spare
    two = by_name(verdict.needs(MEMORY, "cpu", machine(local_ranks=2)))  # every process here counted as rank 0
    assert two["RAM"].need == pytest.approx(26.4 * GB) and two["disk"].need == 8 * GB


def test_on_cuda_one_gpu_holds_one_process_device_bytes_and_ram_the_cpu_bytes_of_all():
    needs = by_name(verdict.needs(MEMORY, "cuda", machine(gpu_name="NVIDIA H100 80GB HBM3", gpu_bytes=80 * GB,
                                                          local_ranks=2)))
    assert needs["GPU memory"].need == 5 * GB and needs["GPU memory"].have == 80 * GB
    assert needs["RAM"].need == pytest.approx(16.4 * GB) and needs["disk"].need == 8 * GB


def test_the_verdict_fits_and_names_the_tightest_resource():
    fits, lines = verdict.judge(verdict.needs(MEMORY, "cpu", machine()), machine())
    assert fits and lines[0].startswith("verdict: fits this machine")
    assert "RAM: needs 13.2 GB" in lines[1] and "of 20 GB available (32 GB total)" in lines[1]
    assert "disk under /scratch: needs 4 GB" in lines[2] and "of 10 GB free" in lines[2]
    assert lines[-1] == "  tightest: RAM, 66% of it used"


def test_the_verdict_names_ram_when_ram_binds_and_by_how_much():
    fits, lines = verdict.judge(verdict.needs(MEMORY, "cpu", machine(ram_available=10 * GB)), machine())
    assert not fits
    assert lines[0] == "verdict: does not fit this machine: RAM 3.2 GB over"
    assert "RAM: needs 13.2 GB (model states 12 GB, activations 1 GB, working memory 200 MB)" in lines[1]
    assert lines[1].endswith("3.2 GB over")


def test_the_verdict_names_the_disk_when_the_disk_binds():
    m = machine(disk_free=3 * GB)
    fits, lines = verdict.judge(verdict.needs(MEMORY, "cpu", m), m)
    assert not fits and lines[0] == "verdict: does not fit this machine: disk 1 GB over"
    assert "swap files" in lines[2] and lines[2].endswith("1 GB over")


def test_swap_files_without_nvme_path_do_not_fit():
    m = machine(disk_path=None, disk_free=None)
    fits, lines = verdict.judge(verdict.needs(MEMORY, "cpu", m), m)
    assert not fits and "no --nvme-path" in lines[0]


def test_on_a_datasheet_gpu_the_search_is_also_a_zfunc_plan_command_that_runs(capsys):
    from recipes import plan as plan_cli

    m = machine(gpu_name="NVIDIA H100 80GB HBM3", gpu_bytes=80 * GB, local_ranks=8)
    assert verdict.gpu_key(m.gpu_name, m.gpu_bytes) == "H100-80GB"
    assert verdict.gpu_key("NVIDIA A100-SXM4-40GB", 40 * GB) == "A100-40GB"
    assert verdict.gpu_key("Tesla T4", 16 * GB) is None
    args = cli.parse_args(llama.RECIPE, ["--flavor", "debug", "--batch-size", "64"])
    line = verdict.plan_command("llama", args, m, 16, "bf16")
    assert line.startswith("python -m recipes.plan --flavor debug --recipe llama --gpu H100-80GB --gpus 16 ")
    assert "--gpus-per-node 8 --cpu-ram 20 --nvme 10 --seq 128 --global-batch 64" in line
    assert plan_cli.main(shlex.split(line)[3:]) == 0 and "1. dp=" in capsys.readouterr().out
    assert verdict.plan_command("llama", args, machine(), 1, "fp32") is None  # a CPU: no datasheet to name


def test_this_machine_reads_ram_and_the_disk_under_the_nearest_existing_folder(tmp_path):
    m = verdict.this_machine(str(tmp_path / "not" / "yet"), "cpu")
    assert 0 < m.ram_available <= m.ram_total and m.disk_path == str(tmp_path) and m.disk_free > 0
    assert not (tmp_path / "not").exists() and m.gpu_bytes is None and m.local_ranks == 1


TINY = ["--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64", "--ffn-dim", "128",
        "--block-size", "32", "--batch-size", "8", "--precision", "fp32"]


def test_a_real_tiny_dry_run_fits_this_machine_and_creates_nothing(tmp_path, text_file, capsys):
    out, swap = tmp_path / "new" / "out", tmp_path / "swap"
    result = llama.main(TINY + ["--data", str(text_file), "--offload-optimizer", "nvme", "--nvme-path", str(swap),
                                "--dry-run", "--out", str(out)])
    printed = capsys.readouterr().out
    assert result["fits"] is True and "verdict: fits this machine" in printed
    assert f"disk under {tmp_path}" in printed  # --nvme-path's nearest existing folder
    assert not (tmp_path / "new").exists() and not swap.exists()


def test_a_run_too_big_for_the_machine_gets_a_layout_that_fits_it(tmp_path, text_file, capsys, monkeypatch):
    """The machine injected: RAM for 60% of what the layout asked for needs, a disk with room. The verdict
    names RAM and gives the recipe's command line with a layout zfunc.plan's search finds fitting; that
    command, dry-run on the same machine, fits."""
    argv = TINY + ["--data", str(text_file), "--offload-optimizer", "nvme", "--nvme-path", str(tmp_path / "swap"),
                   "--dry-run", "--out", str(tmp_path / "out")]
    need = llama.main(argv)["needs"]["RAM"]
    real, small = verdict.this_machine, dict(ram_available=int(0.6 * need), disk_free=100 * GB)
    monkeypatch.setattr(verdict, "this_machine", lambda path, device: verdict.Machine(
        **{**real(path, device).__dict__, **small}))
    capsys.readouterr()
    result = llama.main(argv)
    printed = capsys.readouterr().out
    assert result["fits"] is False and "verdict: does not fit this machine: RAM" in printed
    command = re.search(r"fits instead \(.*\): (python -m recipes\.llama .*)", printed).group(1)
    suggested = shlex.split(command)[3:]
    assert "--dry-run" not in suggested
    given, kept = cli.parse_args(llama.RECIPE, argv), cli.parse_args(llama.RECIPE, suggested)
    same = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "block_size", "batch_size", "precision", "data",
            "out")
    assert [getattr(kept, k) for k in same] == [getattr(given, k) for k in same]
    again = llama.main(suggested + ["--dry-run"])
    assert again["fits"] is True and again["needs"]["RAM"] <= 0.6 * need


def test_nothing_fits_names_the_leanest_layout_and_what_it_needs(tmp_path, text_file, capsys, monkeypatch):
    real = verdict.this_machine
    monkeypatch.setattr(verdict, "this_machine", lambda path, device: verdict.Machine(
        **{**real(path, device).__dict__, "ram_available": 1000}))
    result = llama.main(TINY + ["--data", str(text_file), "--dry-run", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert result["fits"] is False
    assert re.search(r"nothing zfunc.plan's search tries fits this machine .*: the leanest, --zero \d.*, "
                     r"needs RAM [\d.]+ [kMG]?B", printed), printed
    assert "no --nvme-path: swap files not tried" in printed


def test_the_70b_plan_with_everything_on_nvme_names_ram_and_disk_and_the_leanest_layout(tmp_path, capsys,
                                                                                        monkeypatch):
    """The README's 70B dry run on a machine of 32 GB RAM and 100 GB of disk: nothing fits; both are named
    with how much they are over, and the leanest layout the search tries with what it needs."""
    small = machine(ram_available=32 * GB, disk_path=str(tmp_path), disk_free=100 * GB)
    monkeypatch.setattr(verdict, "this_machine", lambda path, device: small)
    swap = tmp_path / "zf"
    # bf16 named: the default precision follows this CPU's bf16 units (fp32 grads, 4 B/param, without them)
    result = llama.main(["--flavor", "70B", "--zero", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme",
                         "--precision", "bf16", "--nvme-path", str(swap), "--dry-run", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    held = 2 * result["n_params"]  # the bf16 grads held for the clip: scratch files, no spares
    assert result["fits"] is False and result["needs"]["disk"] == 2 * result["plan_bytes"]["nvme"] - held
    assert re.search(r"verdict: does not fit this machine: RAM [\d.]+ GB over; disk [\d.]+ TB over", printed)
    assert "the leanest, --zero 3 --offload-optimizer nvme --offload-params " in printed
    assert re.search(r"--remat( --accum 32)?, needs RAM", printed)
    assert not swap.exists() and not (tmp_path / "out").exists()
