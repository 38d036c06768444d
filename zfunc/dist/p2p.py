"""Point-to-point sends and receives (``P2P``) over ``torch.distributed``, or shared rings on one host.

A pipeline's stages pass activations and grads, and the sequence ring its blocks, through a ``P2P``: it
counts the bytes of each direction and names the transfer (what moved, between which stages, at which step)
in the ``CollectiveError`` raised when a peer fails or does not answer, instead of hanging.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zfunc.dist import mailbox
from zfunc.dist.comm import CollectiveError, _nbytes


class P2P:
    """Point-to-point sends and receives between the ranks of ``group`` (a pipeline's stages).

    ``peers[i]`` is the global rank of group member ``i``; callers name peers by group rank.
    ``bytes`` counts "send" and "recv" (each tensor once, on the rank that moves it). Every call
    returns at once; the result's ``wait()`` raises ``CollectiveError`` naming ``label`` (what
    moved, between which stages, at which step) when the peer failed or did not answer within the
    process group's timeout, instead of hanging. Sends and receives between one pair of ranks
    match in call order per ``tag``. On gloo with every rank of the group on this host, a CPU
    tensor up to half a ring (``zfunc.dist.mailbox``: 2 MiB by default) goes through shared memory.
    """

    def __init__(self, group: Any = None, peers: tuple[int, ...] = ()):
        self.group, self.peers = group, tuple(peers)
        self.bytes: Counter = Counter()
        # made by every rank of the group at once (the mesh's construction): its shared-memory rings open now
        self._boxes = mailbox.mailboxes_of(group) if self._on_one_gloo_host() else None

    def _on_one_gloo_host(self) -> bool:
        return (self.group is not None and len(self.peers) > 1 and dist.is_available() and dist.is_initialized()
                and str(dist.get_backend(self.group)) == "gloo")

    def send(self, t: torch.Tensor, to: int, label: str, tag: int = 0) -> _P2PWork:
        """Start sending ``t`` to group rank ``to``; ``t`` must not change until ``wait()``."""
        return self._issue("send", dist.isend, t, to, label, tag)

    def recv(self, t: torch.Tensor, frm: int, label: str, tag: int = 0) -> _P2PWork:
        """Start receiving into ``t`` from group rank ``frm``; read ``t`` after ``wait()``."""
        return self._issue("recv", dist.irecv, t, frm, label, tag)

    def _issue(self, kind: str, op: Callable, t: torch.Tensor, peer: int, label: str, tag: int) -> _P2PWork:
        what = f"{kind} failed during {label}"
        if not 0 <= peer < len(self.peers):
            raise CollectiveError(f"{what}: no peer {peer} in a group of {len(self.peers)} ranks")
        self.bytes[kind] += _nbytes(t)
        boxes = self._boxes
        if boxes is not None and t.device.type == "cpu" and t.is_contiguous() and boxes.fits(_nbytes(t)):
            try:
                work = boxes.send(t, peer, tag) if kind == "send" else boxes.recv(t, peer, tag)
            except Exception as e:
                raise CollectiveError(f"{what}: {e}") from e
            return _P2PWork(work, what, t)
        try:
            work = op(t, self.peers[peer], group=self.group, tag=tag)
        except Exception as e:  # gloo raises at once when the peer's connection is gone
            raise CollectiveError(f"{what}: {e}") from e
        return _P2PWork(work, what, t)


class _P2PWork:
    """A started send or receive; holds its tensor until ``wait()`` has returned."""

    def __init__(self, work: Any, what: str, tensor: torch.Tensor):
        self.work, self.what, self.tensor = work, what, tensor

    def done(self) -> bool:
        """True once the transfer has finished (or failed: ``wait()`` then raises)."""
        done = getattr(self.work, "done", None)  # a transfer through shared memory
        try:
            return done() if done is not None else self.work.is_completed()
        except Exception:
            return True  # failed: wait() raises it

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait()
        except Exception as e:
            raise CollectiveError(f"{self.what}: {e}") from e
        return self.tensor
