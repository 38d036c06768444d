"""The ``zfunc`` console script: the deepspeed launcher's common arguments become a torchrun command line."""
import sys

import pytest

from zfunc.deepspeed.launcher import torchrun_command

RUN = [sys.executable, "-m", "torch.distributed.run"]


def test_common_arguments_become_torchrun():
    assert torchrun_command(["--num_gpus", "2", "train.py", "--deepspeed_config", "c.json"]) == \
        [*RUN, "--nproc_per_node", "2", "--standalone", "train.py", "--deepspeed_config", "c.json"]
    assert torchrun_command(["--num_nodes", "1", "--num_gpus", "2", "--master_port", "29600", "t.py"]) == \
        [*RUN, "--nproc_per_node", "2", "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", "29600",
         "t.py"]


def test_hostfile_of_one_host_sets_the_processes(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the workers\nlocalhost slots=3\n")
    assert torchrun_command(["--hostfile", str(hostfile), "t.py"])[3:5] == ["--nproc_per_node", "3"]
    hostfile.write_text("a slots=2\nb slots=2\n")
    with pytest.raises(SystemExit, match="one host, the file lists 2"):
        torchrun_command(["--hostfile", str(hostfile), "t.py"])


@pytest.mark.parametrize("argv,flag", [(["--num_nodes", "2"], "--num_nodes 2"), (["--include", "localhost:0"],
                                                                                  "--include"),
                                       (["--launcher", "slurm"], "--launcher slurm")])
def test_refused_flags_are_named(argv, flag):
    with pytest.raises(SystemExit, match=flag):
        torchrun_command([*argv, "t.py"])
