"""zf.dist: the mesh over ``torch.distributed``, byte-counting collectives and point-to-point (mesh.py);
starting ranks under ``torchrun`` or with ``spawn`` (launch.py)."""
from zfunc.dist.launch import free_port, init_from_env, loopback_interface, spawn
from zfunc.dist.mesh import P2P, CollectiveError, Comm, Mesh, all_arrive

__all__ = ["CollectiveError", "Comm", "Mesh", "P2P", "all_arrive", "free_port", "init_from_env",
           "loopback_interface", "spawn"]
