"""zf.dist: the mesh over ``torch.distributed``, byte-counting collectives and point-to-point (mesh.py);
the 1-bit compressed all-reduce with error feedback (compressed.py); starting ranks under ``torchrun``
or with ``spawn`` (launch.py); a rank's place without a process group, for dry runs
(``Mesh.planned``, planned.py)."""
from zfunc.dist.compressed import ErrorFeedback, error_feedback
from zfunc.dist.launch import free_port, init_from_env, loopback_interface, spawn
from zfunc.dist.comm import CollectiveError, Comm, all_arrive
from zfunc.dist.p2p import P2P
from zfunc.dist.mesh import Mesh
from zfunc.dist.planned import planned

Mesh.planned = staticmethod(planned)  # zf.Mesh.planned(dp=, pp=, sp=, tp=, rank=): planned.py (it builds on mesh.py)

__all__ = ["CollectiveError", "Comm", "ErrorFeedback", "error_feedback", "Mesh", "P2P", "all_arrive", "free_port",
           "init_from_env", "loopback_interface", "spawn"]
