"""dist: spawn on loopback, the byte-counting Comm, and the mesh's checks."""
import datetime
import ipaddress
import os
import time

import pytest
import torch

import zfunc as zf


def collectives(rank, world):
    mesh = zf.Mesh(dp=world)
    t = torch.full((4,), float(rank + 1))
    mesh.comm.all_reduce(t)
    gathered = torch.empty(2 * world)
    mesh.comm.all_gather(gathered, torch.full((2,), float(rank)))
    in_place = torch.zeros(3 * world)  # this rank's chunk of the output passed as the input: not copied
    mine = in_place[3 * rank : 3 * rank + 3].fill_(rank + 0.5)
    mesh.comm.all_gather(in_place, mine)
    assert in_place.tolist() == [r + 0.5 for r in range(world) for _ in range(3)]
    out = torch.empty(2)
    mesh.comm.reduce_scatter(out, torch.arange(2.0 * world))
    later = torch.empty(3)  # async, as the grad reducer issues it (gloo: an all-to-all + a sum on wait)
    work = mesh.reduce_comm.reduce_scatter(later, torch.arange(3.0 * world) * (rank + 1), async_op=True)
    work.wait()
    mesh.comm.agree((1, 2), lambda op: str(op), "a label")
    try:
        mesh.comm.agree((rank,), lambda op: f"op {op[0]}", "step 7")
        diverged = "no error"
    except zf.dist.CollectiveError as e:
        diverged = str(e)
    return t.tolist(), gathered.tolist(), out.tolist(), later.tolist(), dict(mesh.comm.bytes), diverged, repr(mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_count_bytes_and_agree_checks_ranks(world):
    results = zf.dist.spawn(collectives, world, world)
    rank_sum = world * (world + 1) // 2
    for rank, (t, gathered, out, later, nbytes, diverged, mesh) in enumerate(results):
        assert t == [float(rank_sum)] * 4
        assert gathered == [float(r) for r in range(world) for _ in range(2)]
        assert out == [float(world * (2 * rank)), float(world * (2 * rank + 1))]
        assert later == [float(rank_sum * i) for i in range(3 * rank, 3 * rank + 3)]
        assert nbytes == {"all_reduce": 2 * 16, "all_gather": 20 * world, "reduce_scatter": 8 * world, "agree": 0}
        assert "ranks diverged at step 7: rank 0: op 0; rank 1: op 1" in diverged
        assert mesh == f"Mesh(dp={world}, rank={rank})"


def narrow_reduce_scatter(rank, world):
    """bf16 ``full`` into fp32 ``out`` vs the same values widened first: (equal?, bytes of each)."""
    mesh = zf.Mesh(dp=world)
    full = torch.randn(world * 1000, generator=torch.Generator().manual_seed(rank)).bfloat16()
    narrow, wide = torch.empty(1000), torch.empty(1000)
    mesh.reduce_comm.reduce_scatter(narrow, full)
    sent = mesh.reduce_comm.bytes["reduce_scatter"]
    mesh.reduce_comm.reduce_scatter(wide, full.float())
    return (torch.equal(narrow, wide), mesh.reduce_comm.reduce_dtype(torch.bfloat16), sent,
            mesh.reduce_comm.bytes["reduce_scatter"] - sent)


@pytest.mark.multiprocess
def test_a_bf16_reduce_scatter_into_fp32_sums_the_widened_values_in_half_the_bytes():
    for world in (2, 3):  # 3: a middle rank sends its own chunk to itself (another sum)
        for equal, dtype, narrow, wide in zf.dist.spawn(narrow_reduce_scatter, world, world):
            assert equal and dtype == torch.bfloat16 and (narrow, wide) == (2 * 1000 * world, 4 * 1000 * world)


def failing(rank):
    if rank == 1:
        raise KeyError("boom on rank 1")
    return rank


@pytest.mark.multiprocess
def test_spawn_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*boom on rank 1"):
        zf.dist.spawn(failing, 2)


def quitter(rank):
    import os

    os._exit(0)  # skips the worker's report of a result


@pytest.mark.multiprocess
def test_spawn_names_a_rank_that_exits_without_a_result_at_once():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 of 1 exited \(code 0\) without a result"):
        zf.dist.spawn(quitter, 1, timeout_s=60)
    assert time.monotonic() - t0 < 30  # not the timeout


def sleeper(rank):
    import time

    time.sleep(60)


@pytest.mark.multiprocess
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


def mesh_2x2(rank):
    mesh = zf.Mesh(dp=2, pp=2)
    dp_sum, pp_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    mesh.comm.all_reduce(dp_sum)  # over the ranks holding the same stage
    mesh.pp_comm.all_reduce(pp_sum)  # over one replica's stages
    pp_gathered = torch.empty(2)  # group ranks are not global ranks: pp group {1, 3} has ranks 0, 1
    mesh.pp_comm.all_gather(pp_gathered, torch.tensor([float(rank)]))
    x = torch.full((3,), float(rank))
    if mesh.pp_rank == 0:
        mesh.p2p.send(x, 1, "a test send").wait()
    else:
        mesh.p2p.recv(x, 0, "a test recv").wait()
    errors = []
    for kw in ({"dp": 3, "pp": 2}, {"pp": 3}):
        try:
            zf.Mesh(**kw)
        except ValueError as e:
            errors.append(str(e))
    assert pp_gathered.tolist() == [float(mesh.rank), float(mesh.rank + 2)]
    return (mesh.rank, mesh.pp_rank, dp_sum.item(), pp_sum.item(), x.tolist(), dict(mesh.p2p.bytes),
            repr(mesh), errors)


@pytest.mark.multiprocess
def test_mesh_dp_x_pp_layout_groups_and_p2p():
    for rank, r in enumerate(zf.dist.spawn(mesh_2x2, 4)):
        dp_rank, pp_rank, dp_sum, pp_sum, x, nbytes, text, errors = r
        assert (dp_rank, pp_rank) == (rank % 2, rank // 2)  # global rank = pp_rank * dp + dp_rank
        assert dp_sum == {0: 1.0, 1: 5.0}[pp_rank]  # ranks {0, 1} and {2, 3}
        assert pp_sum == {0: 2.0, 1: 4.0}[dp_rank]  # ranks {0, 2} and {1, 3}
        assert x == [float(dp_rank)] * 3  # stage 1 received its replica's stage 0 tensor
        assert nbytes == {("send" if pp_rank == 0 else "recv"): 12}
        assert text == f"Mesh(dp=2, pp=2, rank={dp_rank}, pp_rank={pp_rank})"
        assert "dp, pp: the mesh has dp * pp = 3 * 2 = 6 ranks but the process group has world size 4" in errors[0]
        assert "pp: the world size 4 is not a multiple of pp=3" in errors[1]


def mesh_2x2x2(rank):
    mesh = zf.Mesh(dp=2, pp=2, tp=2)
    sums = {}
    for axis, comm in (("dp", mesh.comm), ("pp", mesh.pp_comm), ("tp", mesh.tp_comm), ("reduce", mesh.reduce_comm)):
        sums[axis] = torch.tensor([float(rank)])
        comm.all_reduce(sums[axis])
    errors = []
    for kw in ({"dp": 3, "tp": 2}, {"pp": 3, "tp": 2}, {"tp": 0}):
        try:
            zf.Mesh(**kw)
        except ValueError as e:
            errors.append(str(e))
    return (mesh.rank, mesh.pp_rank, mesh.tp_rank, {a: t.item() for a, t in sums.items()}, repr(mesh), errors)


@pytest.mark.multiprocess
def test_mesh_dp_x_pp_x_tp_layout_and_groups():
    for rank, r in enumerate(zf.dist.spawn(mesh_2x2x2, 8)):
        dp_rank, pp_rank, tp_rank, sums, text, errors = r
        # global rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank, sp = 1: tp innermost
        assert rank == (pp_rank * 2 + dp_rank) * 2 + tp_rank
        coords = {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}
        assert zf.dist.mesh.global_rank({"pp": 2, "dp": 2, "tp": 2}, coords) == rank
        base = rank - tp_rank
        assert sums["tp"] == 2 * base + 1  # tp peers are neighbours: {base, base + 1}
        dp_peers = [(pp_rank * 2 + d) * 2 + tp_rank for d in range(2)]  # same stage, same tp slice
        assert sums["dp"] == sums["reduce"] == sum(dp_peers)
        assert sums["pp"] == sum((q * 2 + dp_rank) * 2 + tp_rank for q in range(2))
        assert text == f"Mesh(dp=2, pp=2, tp=2, rank={dp_rank}, pp_rank={pp_rank}, tp_rank={tp_rank})"
        assert "dp, tp: the mesh has dp * tp = 3 * 2 = 6 ranks but the process group has world size 8" in errors[0]
        assert "pp, tp: the world size 8 is not a multiple of pp * tp = 3 * 2 = 6" in errors[1]
        assert "tp: expected an int >= 1, got 0" in errors[2]


def mesh_tp2(rank):
    mesh = zf.Mesh(tp=2)
    t = torch.tensor([float(rank + 1)])
    mesh.tp_comm.all_reduce(t)
    dp = torch.tensor([float(rank + 1)])
    mesh.comm.all_reduce(dp)  # a dp group of one: tp peers are not in it
    return mesh.dp, mesh.rank, mesh.tp_rank, t.item(), dp.item(), dict(mesh.tp_comm.bytes), mesh.comm_bytes()


@pytest.mark.multiprocess
def test_mesh_of_tp_alone():
    assert zf.dist.spawn(mesh_tp2, 2) == [(1, 0, r, 3.0, float(r + 1), {"all_reduce": 8}, {"all_reduce": 8})
                                         for r in range(2)]


def test_mesh_coordinates_invert_global_rank():
    sizes = {"pp": 3, "dp": 2, "sp": 2, "tp": 2}
    for rank in range(24):
        assert zf.dist.mesh.global_rank(sizes, zf.dist.mesh.coordinates(sizes, rank)) == rank
    assert zf.dist.mesh.axis_groups({"pp": 2, "dp": 2, "tp": 2}, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert zf.dist.mesh.axis_groups({"pp": 2, "dp": 2, "tp": 2}, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    mesh = zf.Mesh()
    assert (mesh.tp, mesh.tp_rank) == (1, 0) and mesh.tp_comm.alone


def lonely_recv(rank):
    mesh = zf.Mesh(pp=2)
    if rank == 1:
        mesh.p2p.recv(torch.empty(3), 0, "recv of the activation of microbatch 0 from stage 0 to 1 at step 0").wait()


@pytest.mark.multiprocess
def test_p2p_failure_names_the_transfer():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*CollectiveError: recv failed during recv of the "
                                           "activation of microbatch 0 from stage 0 to 1 at step 0"):
        zf.dist.spawn(lonely_recv, 2, timeout_s=20)


def listening_addresses(pid):
    """The addresses of the TCP sockets process ``pid`` listens on, read from /proc (Linux)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    address, port = cols[1].split(":")
                    raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                    found.append((getattr(ip, "ipv4_mapped", None) or ip, int(port, 16)))
    return found


def report_listeners(rank, world, parent):
    mesh = zf.Mesh(dp=2)  # the default group and the reduce group: gloo devices of their own
    t = torch.ones(1)
    mesh.comm.all_reduce(t)
    mesh.reduce_comm.all_reduce(t)
    return listening_addresses(os.getpid()), listening_addresses(parent), int(os.environ["MASTER_PORT"])


def non_loopback_interface():
    """The interface of the default route, or None."""
    try:
        with open("/proc/net/route") as f:
            routes = [line.split() for line in f][1:]
    except OSError:
        return None
    return next((cols[0] for cols in routes if cols[1] == "00000000"), None)


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from Linux's /proc")
@pytest.mark.parametrize("gloo_ifname", [None, "default route's"])
def test_spawn_listens_on_loopback_only(gloo_ifname, monkeypatch):
    """The parent's store and every rank's gloo sockets accept connections from this machine only,
    whatever the hostname resolves to or GLOO_SOCKET_IFNAME says."""
    if gloo_ifname:
        gloo_ifname = non_loopback_interface()
        if gloo_ifname is None:
            pytest.skip("no interface besides loopback")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", gloo_ifname)
    for rank, (own, parent, store_port) in enumerate(zf.dist.spawn(report_listeners, 2, 2, os.getpid())):
        assert own, f"rank {rank}: gloo listens on nothing?"
        assert store_port in [port for _, port in parent], parent
        for ip, port in own + parent:
            assert ip.is_loopback, f"rank {rank} or its parent listens on {ip} port {port}"


def report_parent_and_environment(rank, world):
    return os.getppid(), os.environ.get("PYTEST_CURRENT_TEST"), os.environ.get("ZFUNC_TEST_MARK")


@pytest.mark.multiprocess
@pytest.mark.skipif(zf.dist.launch.SPAWN_METHOD != "forkserver", reason="ZFUNC_SPAWN_METHOD=spawn")
def test_ranks_fork_from_the_server_with_the_callers_environment_unless_it_changed(monkeypatch):
    monkeypatch.delenv("ZFUNC_TEST_MARK", raising=False)
    now = os.environ["PYTEST_CURRENT_TEST"]  # differs from test to test: it does not stop a fork
    for parent, current, mark in zf.dist.spawn(report_parent_and_environment, 2, 2):
        assert parent != os.getpid() and current == now and mark is None  # forked by the server
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # torch sets it on first use: still forked
    for parent, current, mark in zf.dist.spawn(report_parent_and_environment, 2, 2):
        assert parent != os.getpid()
    monkeypatch.setenv("ZFUNC_TEST_MARK", "set")  # zfunc or torch could read it at import: fresh interpreters
    for parent, current, mark in zf.dist.spawn(report_parent_and_environment, 2, 2):
        assert parent == os.getpid() and mark == "set"


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts open fds in Linux's /proc")
def test_a_store_that_fails_to_start_leaves_no_socket_open(monkeypatch):
    def refuse(*args, master_listen_fd, **kwargs):
        raise torch.distributed.DistNetworkError(f"refused fd {master_listen_fd}")

    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(zf.dist.launch.dist, "TCPStore", refuse)
    with pytest.raises(torch.distributed.DistNetworkError, match="refused fd"):
        zf.dist.launch._loopback_store(datetime.timedelta(seconds=5))
    assert sorted(os.listdir("/proc/self/fd")) == before


def mesh_dp_sp(rank):
    mesh = zf.Mesh(dp=2, sp=2)
    dp_sum, sp_sum, all_sum = (torch.tensor([float(rank)]) for _ in range(3))
    mesh.comm.all_reduce(dp_sum)
    mesh.sp_comm.all_reduce(sp_sum)
    mesh.dp_sp.comm.all_reduce(all_sum)
    out = torch.empty(4)  # chunk s of out <- rank s's chunk (my sp rank) of its input
    mesh.sp_comm.all_to_all(out, torch.tensor([10.0 * rank, 10.0 * rank + 1, 10.0 * rank + 2, 10.0 * rank + 3]))
    x = torch.full((2,), float(rank))
    sends = mesh.sp_p2p.send(x.clone(), 1 - mesh.sp_rank, "a test send"), mesh.sp_p2p.recv(x, 1 - mesh.sp_rank, "recv")
    [w.wait() for w in sends]
    try:
        zf.Mesh(sp=3)
    except ValueError as e:
        error = str(e)
    return (mesh.rank, mesh.sp_rank, mesh.dp_sp.dp, mesh.dp_sp.rank, dp_sum.item(), sp_sum.item(), all_sum.item(),
            out.tolist(), x.tolist(), mesh.sp_comm.bytes["all_to_all"], repr(mesh), error)


@pytest.mark.multiprocess
def test_mesh_dp_x_sp_layout_groups_all_to_all_and_ring_peers():
    for rank, r in enumerate(zf.dist.spawn(mesh_dp_sp, 4)):
        dp_rank, sp_rank, flat_dp, flat_rank, dp_sum, sp_sum, all_sum, out, x, a2a, text, error = r
        assert (dp_rank, sp_rank) == (rank // 2, rank % 2)  # global rank = dp_rank * sp + sp_rank
        assert (flat_dp, flat_rank) == (4, rank)  # dp_sp: the dp x sp ranks ZeRO shards over
        assert dp_sum == {0: 2.0, 1: 4.0}[sp_rank]  # ranks {0, 2} and {1, 3}
        assert sp_sum == {0: 1.0, 1: 5.0}[dp_rank]  # ranks {0, 1} and {2, 3}
        assert all_sum == 6.0
        peers = [2 * dp_rank, 2 * dp_rank + 1]  # my sequence group, in sp order
        assert out == [10.0 * p + c for p in peers for c in (2 * sp_rank, 2 * sp_rank + 1)]
        assert x == [float(peers[1 - sp_rank])] * 2
        assert a2a == 16
        assert text == f"Mesh(dp=2, sp=2, rank={dp_rank}, sp_rank={sp_rank})"
        assert "sp: the world size 4 is not a multiple of sp=3" in error
