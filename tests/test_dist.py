"""dist: spawn on loopback, the byte-counting Comm, and the mesh's checks."""
import pytest
import torch

import zfunc as zf


def collectives(rank, world):
    mesh = zf.Mesh(dp=world)
    t = torch.full((4,), float(rank + 1))
    mesh.comm.all_reduce(t)
    gathered = torch.empty(2 * world)
    mesh.comm.all_gather(gathered, torch.full((2,), float(rank)))
    out = torch.empty(2)
    mesh.comm.reduce_scatter(out, torch.arange(2.0 * world))
    mesh.comm.agree((1, 2), lambda op: str(op), "a label")
    try:
        mesh.comm.agree((rank,), lambda op: f"op {op[0]}", "step 7")
        diverged = "no error"
    except zf.dist.CollectiveError as e:
        diverged = str(e)
    return t.tolist(), gathered.tolist(), out.tolist(), dict(mesh.comm.bytes), diverged, repr(mesh)


def test_collectives_count_bytes_and_agree_checks_ranks():
    results = zf.dist.spawn(collectives, 2, 2)
    for rank, (t, gathered, out, nbytes, diverged, mesh) in enumerate(results):
        assert t == [3.0] * 4
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert out == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert nbytes == {"all_reduce": 2 * 16, "all_gather": 16, "reduce_scatter": 16, "agree": 0}
        assert "ranks diverged at step 7: rank 0: op 0; rank 1: op 1" in diverged
        assert mesh == f"Mesh(dp=2, rank={rank})"


def failing(rank):
    if rank == 1:
        raise KeyError("boom on rank 1")
    return rank


def test_spawn_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*boom on rank 1"):
        zf.dist.spawn(failing, 2)


def sleeper(rank):
    import time

    time.sleep(60)


def test_spawn_times_out():
    with pytest.raises(TimeoutError, match="did not finish in 3"):
        zf.dist.spawn(sleeper, 1, timeout_s=3)


def test_mesh_of_one_without_a_process_group():
    mesh = zf.Mesh()
    assert (mesh.dp, mesh.rank, mesh.size) == (1, 0, 1)
    out = torch.empty(3)
    mesh.comm.all_gather(out, torch.ones(3))
    assert out.tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="dp: expected an int >= 1"):
        zf.Mesh(dp=0)
    with pytest.raises(ValueError, match="world_size"):
        zf.dist.spawn(failing, 0)
