"""A test-only process group with NCCL's point-to-point rules, wrapped around gloo.

gloo buffers a send and matches messages by (source, tag), so code that would hang under NCCL
runs fine on it. This group makes a CPU run fail the way a GPU run would:

- **A send completes only when the peer's matching receive is reached** (its stream got to the
  receive), not when the data is buffered: the data goes out over gloo, then the send waits for
  the receiver's acknowledgement, sent when the receiver's stream starts the receive.
- **Ops between one pair of ranks run in order, on one stream** (a thread per peer): an
  ungrouped send blocks every later op of that pair until it is matched. Tags are ignored, as
  NCCL ignores them: messages match in issue order.
- **The first ungrouped p2p between a pair is a rendezvous of the pair** (NCCL creates the pair's
  communicator then, blocking the host until the peer also calls a p2p op on that pair).
- **Grouped p2p (``batch_isend_irecv``) progresses together** on the group's communicator, whose
  first use (a collective or a batch) is a rendezvous of every rank of the group.

Collectives (all-reduce, all-gather, reduce-scatter, all-to-all, ...) run on gloo as they are:
NCCL imposes nothing on them that gloo lacks. A rule broken shows up as a
:class:`NCCLRulesError` naming the op, the ranks and what NCCL would do, after ``timeout``
seconds, on the rank(s) that would hang.

Use: ``group = nccl_rules_group(ranks, timeout=5)`` inside ranks with a gloo default group, and
``patch_batch_isend_irecv()`` once per process so torch's batch API reaches it.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_ACK = torch.zeros(1, dtype=torch.int32)


class NCCLRulesError(RuntimeError):
    """What would be a hang under NCCL."""


class _Work(dist.Work):
    def __init__(self, what: str, timeout: float):
        super().__init__()
        self.what, self.timeout = what, timeout
        self._done, self._error = threading.Event(), None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        # The op's own checks fail after `timeout` with the reason; this is only a backstop.
        if not self._done.wait(2 * self.timeout + 1):
            raise NCCLRulesError(f"{self.what} did not complete within {self.timeout:g}s")
        if isinstance(self._error, NCCLRulesError):
            raise self._error
        if self._error is not None:
            raise NCCLRulesError(f"{self.what} failed: {self._error}") from self._error
        return True


class _Stream:
    """Runs queued ops one after another, as a CUDA stream does; broken after a failure."""

    def __init__(self, name: str):
        self._ops: queue.Queue = queue.Queue()
        self._broken: BaseException | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, work = self._ops.get()
            if self._broken is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported through the work
                    self._broken = e
            work.finish(self._broken)

    def enqueue(self, fn, work: _Work) -> _Work:
        self._ops.put((fn, work))
        return work


class NCCLRulesGroup(dist.ProcessGroup):
    """See the module doc. Built by :func:`nccl_rules_group`."""

    sends_wait_for_receives = True      # what fastpar.pipeline.p2p.sends_wait reads

    def __init__(self, ranks: list[int], timeout: float):
        self.ranks, self.timeout = list(ranks), float(timeout)
        me = dist.get_rank()
        super().__init__(self.ranks.index(me), len(self.ranks))
        opts = timedelta(seconds=2 * timeout)               # gloo's own, beyond ours
        self._gloo = dist.new_group(self.ranks, timeout=opts)        # collectives
        self._wire = dist.new_group(self.ranks, timeout=opts)        # p2p data and acks
        self._store = dist.PrefixStore(f"nccl_rules/{'-'.join(map(str, ranks))}/",
                                       c10d._get_default_store())
        self._streams: dict[object, _Stream] = {}
        self._pairs: set[int] = set()                      # peers with a pair communicator
        self._group_comm = False
        self._seq: dict[tuple, int] = {}                   # (comm, direction, peer) -> count
        self.events: list[tuple] = []                      # (kind, peer, grouped), for tests

    # -- identity ------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the C++ name the trampoline looks up
        return "nccl_rules"

    # -- communicator creation -----------------------------------------------------------------
    def _rendezvous(self, name: str, members: list[int], what: str) -> None:
        self._store.set(f"{name}/{self.rank()}", "1")
        keys = [f"{name}/{m}" for m in members]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
            raise NCCLRulesError(
                f"rank {self.rank()}: {what}: creating the communicator of ranks {members} "
                f"timed out after {self.timeout:g}s: not every one of them called a p2p op on "
                "it (NCCL creates it at the first call, blocking until all arrive)") from e

    def _pair_comm(self, peer: int, what: str) -> None:
        if peer not in self._pairs:
            lo, hi = sorted((self.rank(), peer))
            self._rendezvous(f"pair/{lo}-{hi}", [lo, hi], what)
            self._pairs.add(peer)

    def _whole_comm(self, what: str) -> None:
        if not self._group_comm:
            self._rendezvous("group", list(range(self.size())), what)
            self._group_comm = True

    # -- the wire: data, then the receiver's acknowledgement -----------------------------------
    def _tag(self, comm: str, direction: str, peer: int) -> int:
        key = (comm, direction, peer)
        n = self._seq.get(key, 0)
        self._seq[key] = n + 1
        return 4 * n + (comm == "group") * 2

    def _post_send(self, t: torch.Tensor, peer: int, tag: int):
        data = self._wire.send([t.contiguous()], peer, tag)   # gloo waits for the receiver too
        return data, self._wire.recv([_ACK.clone()], peer, tag + 1)

    def _finish_send(self, data, ack, peer: int, what: str) -> None:
        try:
            ack.wait(timedelta(seconds=self.timeout))
            data.wait()
        except Exception as e:  # noqa: BLE001
            raise NCCLRulesError(
                f"rank {self.rank()}: {what} was not matched by a receive on rank {peer} within "
                f"{self.timeout:g}s: under NCCL the send blocks its stream until the peer's "
                "receive runs (deadlock)") from e

    def _send_now(self, t: torch.Tensor, peer: int, tag: int, what: str) -> None:
        self._finish_send(*self._post_send(t, peer, tag), peer, what)

    def _post_recv(self, t: torch.Tensor, peer: int, tag: int):
        ack = self._wire.send([_ACK.clone()], peer, tag + 1)     # "my receive is running"
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        return t, buf, ack, self._wire.recv([buf], peer, tag)

    def _finish_recv(self, t, buf, ack, data) -> None:
        data.wait()
        ack.wait()
        if buf is not t:
            t.copy_(buf)

    def _recv_now(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self._finish_recv(*self._post_recv(t, peer, tag))

    def _stream(self, key) -> _Stream:
        if key not in self._streams:
            self._streams[key] = _Stream(f"nccl-rules-{key}")
        return self._streams[key]

    # -- ungrouped p2p: the pair's stream ------------------------------------------------------
    def send(self, tensors, dst: int, tag: int):
        what = f"send of {tuple(tensors[0].shape)} to rank {dst}"
        self._pair_comm(dst, what)
        self.events.append(("send", dst, False))
        seq = self._tag("pair", "out", dst)
        t = tensors[0]
        return self._stream(dst).enqueue(lambda: self._send_now(t, dst, seq, what),
                                         _Work(f"rank {self.rank()}: {what}", self.timeout))

    def recv(self, tensors, src: int, tag: int):
        what = f"receive of {tuple(tensors[0].shape)} from rank {src}"
        self._pair_comm(src, what)
        self.events.append(("recv", src, False))
        seq = self._tag("pair", "in", src)
        t = tensors[0]
        return self._stream(src).enqueue(lambda: self._recv_now(t, src, seq),
                                         _Work(f"rank {self.rank()}: {what}", self.timeout))

    # -- grouped p2p: all ops of the batch progress together on the group's stream ----------
    def batch(self, p2p_ops: list[dist.P2POp]) -> list[dist.Work]:
        self._whole_comm("batch_isend_irecv")
        plan = []
        for op in p2p_ops:
            peer = op.group_peer
            out = op.op in (dist.isend, dist.send)
            self.events.append(("send" if out else "recv", peer, True))
            plan.append((out, op.tensor, peer, self._tag("group", "out" if out else "in", peer)))

        def run():                                     # everything posted at once
            recvs = [self._post_recv(t, peer, tag) for out, t, peer, tag in plan if not out]
            sends = [(peer, self._post_send(t, peer, tag)) for out, t, peer, tag in plan if out]
            for peer, posted in sends:
                self._finish_send(*posted, peer, f"grouped send to rank {peer}")
            for posted in recvs:
                self._finish_recv(*posted)
        work = _Work(f"rank {self.rank()}: a batch of {len(p2p_ops)} p2p ops", self.timeout)
        return [self._stream("group").enqueue(run, work)]

    # -- collectives: gloo's, after the group communicator exists ------------------------------
    def allreduce(self, tensors, opts):
        self._whole_comm("all_reduce")
        return self._gloo.allreduce(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self._whole_comm("all_gather")
        return self._gloo.allgather(outputs, inputs, opts)

    def _allgather_base(self, output, input, opts=None):
        self._whole_comm("all_gather_into_tensor")
        return self._gloo._allgather_base(output, input)

    def reduce_scatter(self, outputs, inputs, opts):
        self._whole_comm("reduce_scatter")
        return self._gloo.reduce_scatter(outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts):
        self._whole_comm("reduce_scatter_tensor")
        return self._gloo._reduce_scatter_base(output, input, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        self._whole_comm("all_to_all")
        return self._gloo.alltoall_base(output, input, output_splits, input_splits, opts)

    def broadcast(self, tensors, opts):
        self._whole_comm("broadcast")
        return self._gloo.broadcast(tensors, opts)

    def barrier(self, opts=None):
        self._whole_comm("barrier")
        return self._gloo.barrier()


def nccl_rules_group(ranks: list[int] | None = None, timeout: float = 5.0) -> NCCLRulesGroup:
    """A group over ``ranks`` (default: all) with NCCL's p2p rules; every rank must call it.

    Registered like a group from ``new_group``: torch.distributed's functions and the
    extension's ops (which resolve a group by name) reach it.
    """
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    pg = NCCLRulesGroup(ranks, timeout)
    name = f"nccl_rules_{'_'.join(map(str, ranks))}_{len(c10d._world.pg_group_ranks)}"
    # Ops the trampoline does not forward to Python (the C++ _allgather_base, ...) go to a gloo
    # backend of their own; the group's name is that backend's, so it is set after.
    spare = dist.new_group(ranks)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                         spare._get_backend(torch.device("cpu")))
    pg._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, pg)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    c10d._world.pg_names[pg] = name
    c10d._world.pg_map[pg] = ("gloo", pg._store)
    return pg


def patch_batch_isend_irecv() -> None:
    """Route ``dist.batch_isend_irecv`` on a rules group to its grouped path, as torch does for
    NCCL (torch only coalesces for its own ProcessGroup class)."""
    original = c10d.batch_isend_irecv
    if getattr(original, "_nccl_rules", False):
        return

    def batch_isend_irecv(p2p_op_list):
        group = p2p_op_list[0].group if p2p_op_list else None
        if isinstance(group, NCCLRulesGroup):
            return group.batch(p2p_op_list)
        return original(p2p_op_list)
    batch_isend_irecv._nccl_rules = True
    c10d.batch_isend_irecv = dist.batch_isend_irecv = batch_isend_irecv
