"""zf.dist: the mesh over ``torch.distributed``, byte-counting collectives and point-to-point, and ``spawn``."""
from zfunc.dist.mesh import (P2P, CollectiveError, Comm, Mesh, all_arrive, free_port,
                             init_from_env, loopback_interface, spawn)

__all__ = ["CollectiveError", "Comm", "Mesh", "P2P", "all_arrive", "free_port", "init_from_env",
           "loopback_interface", "spawn"]
