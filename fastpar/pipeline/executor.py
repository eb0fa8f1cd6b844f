"""One executor for every schedule: it walks this rank's action list, nothing else decides order.

``F`` runs a chunk's stage on a micro-batch (the last stage adds ``loss_fn``, scaled by 1/M so the
gradients are those of the mean loss over the batch); ``B`` runs its backward, or only the input
gradient when the schedule has ``W``; ``W`` the deferred weight gradients (:mod:`.backward`). A
run of communication actions is one ``batch_isend_irecv`` batch, posted without waiting: the
schedule places each receive in the round its message is sent, so receives are posted long before
they are needed, and a compute action waits only for the one message it consumes. An overlapped
pair's F that feeds another rank posts that send as soon as it has run, before the pair's B
(:meth:`Schedule.early_sends <fastpar.pipeline.actions.Schedule.early_sends>`). On CUDA the
batches go out from a dedicated stream; on CPU gloo's threads move the data.

A micro-batch's activations (its stage input, output and autograd graph) are dropped as soon as its
last backward action has run, so 1F1B holds at most ``pp`` of them and GPipe ``M``; ``step``
records the peak it saw in :attr:`PipelineExecutor.peak_activations`.

Shapes: when the model says what passes between its stages (``activation=(shape, dtype)``, as
the trainer does for the GPT's hidden states), the receive buffers are sized from that, with no
message; each rank checks the batch it was given itself (pass the batch to every rank, as the
trainer does, so a bad one raises the same error everywhere), and a stage whose output differs
from the declared activation raises before sending it. Without it, the first step sends each
stage's output shape and dtype down the pipeline once (:mod:`.shapes`) and carries errors found
in the batch to every rank on the way. Either way later steps must use the same micro-batch
shape.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import p2p
from .backward import Capture, backward_input_steps, backward_weight, deferrable
from ..mesh import fill
from ..mesh.profiling import span
from .actions import Schedule
from .schedules import forward_schedule
from .shapes import batch_error, exchange_shapes
from .simulate import Event


@dataclass
class _Live:
    x: torch.Tensor | None               # the stage input (requires grad past stage 0)
    out: torch.Tensor | None             # the stage output, or the scaled loss on the last stage
    captured: object = None     # split backward: the Capture of F (outputs, graph cuts)
    pending: list = field(default_factory=list)     # split backward: what W still has to do


@dataclass
class _Step:
    xs: list | None
    ts: list | None
    live: dict = field(default_factory=dict)         # (micro-batch, chunk) -> _Live
    recvs: dict = field(default_factory=dict)        # message -> (buffer, works)
    grads: dict = field(default_factory=dict)        # (micro-batch, chunk) -> input gradient
    sends: list = field(default_factory=list)        # (works, tensor, message)
    losses: list = field(default_factory=list)
    peak: int = 0
    events: list = field(default_factory=list)
    arrived: float | None = None                     # when the current action's input arrived
    keep: bool = True                                # keep activations for backward
    filled: float = 0.0                              # seconds the current pair's B ran
    docs: list | None = None                         # each micro-batch's ``docs`` keyword


class PipelineExecutor:
    """Runs ``schedule`` on this rank's ``stages`` (one module per chunk, in chunk order).

    ``pp_group``: the pipeline group (``mesh.pp_group``), or None for a single process.
    ``loss_fn(output, target)`` runs on the last stage. ``grads_ready(chunk, stage)`` is called
    once per step per chunk right after that chunk's last gradient is in ``.grad`` (often in the
    cool-down, while other chunks and ranks still compute): the place for data-parallel code to
    start reducing that chunk's gradients. ``before_backward(chunk, final)`` is called right
    before each backward action (``B``, and ``W`` with a split backward) with ``final`` True when
    that action is the chunk's last of its kind, so that the gradients it accumulates are final:
    the place to switch a bucketed reduction on (``DataParallel.set_requires_gradient_sync(final,
    wait_in_backward=False)``), which then starts each bucket from inside that backward, as soon
    as the bucket is complete. ``grads_set(chunk, params)`` is called after each ``B`` of a split
    backward with the parameters whose gradients that B added to ``.grad`` by hand (they get no
    post-accumulate-grad hook): data-parallel code counts them as hooks would. Waits are bounded by the pipeline group's own timeout
    (``fastpar.init(timeout=...)``): a host-side timeout would spin the CPU under NCCL.
    ``overlap=False`` waits for each batch of sends and receives right after
    posting it (the strict model every schedule is validated under, so it cannot deadlock): the
    same numbers, no communication behind compute. ``record=True`` keeps each step's measured
    timeline in ``events`` (compute only: an action's time starts when its input has arrived;
    seconds since ``step_start``, a ``time.perf_counter()`` reading; CPU clocks, so on CUDA it
    shows launch times unless the caller synchronises). ``activation=(shape, dtype)``: what
    passes between stages (see the module doc). ``stage_loss=True``: the last stage computes
    the loss itself, called as ``stage(x, target)`` (fastpar's GPT does, given targets: it then
    reads the head's output in place, padding columns included, with no masked copy of the
    logits); ``loss_fn`` is not called. ``recv_ahead``: each batch of messages also posts the
    receives of the next that many batches (:meth:`Schedule.issue_plan`); default 2 on gloo,
    whose receives match by tag and whose sends wait for a posted receive, else 0 (under NCCL
    a posted receive would hold the stream this rank's later sends go out on).
    """

    def __init__(self, stages: list[nn.Module], schedule: Schedule, pp_group=None, *,
                 loss_fn: Callable, grads_ready: Callable | None = None,
                 before_backward: Callable | None = None, grads_set: Callable | None = None,
                 overlap: bool = True,
                 record: bool = False, activation: tuple | None = None,
                 stage_loss: bool = False, recv_ahead: int | None = None):
        if not isinstance(schedule, Schedule):
            raise ValueError(f"PipelineExecutor: schedule must be a Schedule (build_schedule), "
                             f"got {type(schedule).__name__}")
        size = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.rank = dist.get_rank(pp_group) if pp_group is not None else 0
        if schedule.pp_size != size:
            raise ValueError(f"PipelineExecutor: the schedule is for pp_size="
                             f"{schedule.pp_size}, the pipeline group has {size} ranks")
        stages = list(stages)
        if len(stages) != schedule.virtual_stages:
            raise ValueError(f"PipelineExecutor: {len(stages)} stage module(s) on pp rank "
                             f"{self.rank}, the schedule has virtual_stages="
                             f"{schedule.virtual_stages} (one module per chunk)")
        for c, st in enumerate(stages):
            want = schedule.stage_index(self.rank, c)
            got = (getattr(st, "stage_index", want), getattr(st, "num_stages", schedule.num_stages))
            if got != (want, schedule.num_stages):
                raise ValueError(f"PipelineExecutor: chunk {c} on pp rank {self.rank} must be "
                                 f"stage {want} of {schedule.num_stages}, got stage {got[0]} of "
                                 f"{got[1]}")
        if not callable(loss_fn):
            raise ValueError("PipelineExecutor: loss_fn must be callable as "
                             "loss_fn(output, target)")
        if schedule.placement != "loop" and activation is None and size > 1:
            raise ValueError(f"PipelineExecutor: schedule {schedule.name!r} places its stages "
                             f"in a {schedule.placement!r}; declare what passes between them "
                             f"(activation=(shape, dtype))")
        self.stages, self.schedule, self.pp_group = stages, schedule, pp_group
        self.loss_fn, self.grads_ready, self.record = loss_fn, grads_ready, record
        self.before_backward, self.grads_set = before_backward, grads_set
        self.overlap = overlap
        params = [p for st in stages for p in st.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._peers = [dist.get_global_rank(pp_group, r) if pp_group is not None else 0
                       for r in range(size)]
        self._split = [deferrable(st) for st in stages] if schedule.split_backward else None
        self._meta: dict = {}                   # ("in" | "out", stage) -> (shape, dtype)
        self.stage_loss = bool(stage_loss)
        self.activation = None if activation is None else \
            (torch.Size(activation[0]), activation[1])
        acts = schedule.actions[self.rank]
        done = "W" if schedule.split_backward else "B"
        self._chunk_done = {max(i for i, a in enumerate(acts) if a.kind == done and a.chunk == c): c
                            for c in range(schedule.virtual_stages)}
        # The chunk's last B (and last W): the actions after which its gradients are final.
        self._final = {max(i for i, a in enumerate(acts) if a.kind == kind and a.chunk == c)
                       for kind in {"B", done} for c in range(schedule.virtual_stages)}
        self._forward_schedule: Schedule | None = None
        self._points: dict = {}     # (kind, chunk) -> fill points it reached when run alone
        # Split backwards whose W comes right after their B (DualPipeV's unsplit ones): one
        # pass computes both, the W has nothing left to do.
        order = schedule.compute(self.rank)
        self._full = {(a.microbatch, a.chunk) for a, b in zip(order, order[1:])
                      if a.kind == "B" and b.kind == "W" and
                      (a.microbatch, a.chunk) == (b.microbatch, b.chunk)}
        gloo = size > 1 and not p2p.sends_wait(pp_group)
        if recv_ahead is None:          # receives matched by tag (gloo) can go out early
            recv_ahead = 2 if overlap and gloo else 0
        if not isinstance(recv_ahead, int) or recv_ahead < 0:
            raise ValueError(f"PipelineExecutor: recv_ahead={recv_ahead!r} must be an int >= 0")
        self.recv_ahead = recv_ahead
        # A pair's send right after its F: where sends do not wait for their receives (gloo),
        # or where the order still finishes if they do (NCCL's comm stream).
        self._early_ok = overlap and (gloo or size == 1 or
                                      schedule.early_sends_block_safely())
        self._plans: dict = {}          # (schedule name, training) -> issue plan
        self.peak_activations = 0
        self.events: list[Event] = []
        self.step_start = 0.0

    # -- one training step --------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None,
             targets: torch.Tensor | None = None, docs: list | None = None
             ) -> torch.Tensor | None:
        """Run one step on a batch; returns the mean micro-batch loss on the rank holding the
        last stage, None elsewhere. Gradients accumulate into ``.grad`` (zero them between
        steps). ``inputs`` is needed where stage 0 lives, ``targets`` where the last stage does.
        ``docs``: one value per micro-batch, passed to every stage's call on that micro-batch
        as the keyword ``docs`` (packed documents: :class:`fastpar.models.documents.Documents`)."""
        return self._run(self.schedule, inputs, targets, docs)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None = None,
                 targets: torch.Tensor | None = None, docs: list | None = None
                 ) -> torch.Tensor | None:
        """The mean micro-batch loss of a batch, forward only (Megatron's ``forward_only``): the
        schedule's forwards in the same order, no graph kept, each activation dropped once sent.
        Returns it on the rank holding the last stage, None elsewhere."""
        if self._forward_schedule is None:
            self._forward_schedule = forward_schedule(self.schedule)
        return self._run(self._forward_schedule, inputs, targets, docs)

    def _run(self, s: Schedule, inputs, targets, docs=None) -> torch.Tensor | None:
        training = s is self.schedule
        has_first = any(s.stage_index(self.rank, c) == 0 for c in range(s.virtual_stages))
        has_last = self.rank == s.place(s.num_stages - 1)[0]
        given = self.activation is not None     # then every rank checks what it was given
        xs, x_err = self._split_batch(inputs, has_first or (given and inputs is not None), 1)
        ts, t_err = self._split_batch(targets, has_last or (given and targets is not None), 3)
        if (given or self._meta) and (x_err or t_err):
            raise batch_error(*(x_err or t_err))
        if not self._meta:
            self._meta = self._declared(s, xs) if given else exchange_shapes(
                self.stages, s, self.rank, self._peers, self.pp_group, self.device, xs, x_err,
                t_err)
        if has_first and xs[0].shape != self._meta[("in", 0)][0]:
            raise ValueError(f"pipeline step: micro-batch shape {tuple(xs[0].shape)} differs "
                             f"from the first step's {tuple(self._meta[('in', 0)][0])}; the "
                             f"shapes are fixed at the first step, build a new PipelineExecutor")
        if docs is not None and len(docs) != s.num_microbatches:
            raise ValueError(f"pipeline step: {len(docs)} docs for {s.num_microbatches} "
                             "micro-batches")
        st = _Step(xs, ts, keep=training, docs=docs)
        start = time.perf_counter()
        acts = s.actions[self.rank]
        for kind, i, send in self._plan(s, training):
            if kind == "post":
                batch = [acts[k] for k in i]
                with span("pipeline", *batch):
                    self._post(st, batch)
                continue
            a = acts[i]
            pair = acts[i + 1] if kind == "pair" else None
            b = pair or a
            if b.kind != "F" and self.before_backward is not None:
                self.before_backward(b.chunk, (i + 1 if pair else i) in self._final)
            st.arrived, t0 = None, time.perf_counter()
            if pair is not None:        # F and the B of another micro-batch, taking turns
                with span("pipeline", a, pair):
                    self._overlapped(st, a, pair, None if send is None else acts[send])
            else:
                calls = fill.calls
                with span("pipeline", a):
                    {"F": self._forward, "B": self._backward, "W": self._weight}[a.kind](st, a)
                self._points[a.kind, a.chunk] = fill.calls - calls
            if self.record and training:            # compute time only, not the input's wait
                t0, t1 = (st.arrived or t0) - start, time.perf_counter() - start
                if pair is None:
                    st.events.append(Event(self.rank, a, t0, t1))
                else:       # interleaved: shown as F, then B for the time B's steps took
                    st.events += [Event(self.rank, a, t0, t1 - st.filled),
                                  Event(self.rank, pair, t1 - st.filled, t1)]
            for j in (i, i + 1) if pair is not None else (i,):
                if training and j in self._chunk_done and self.grads_ready is not None:
                    self.grads_ready(acts[j].chunk, self.stages[acts[j].chunk])
            st.sends = [x for x in st.sends if not all(w.is_completed() for w in x[0])]
        for works, _, msg in st.sends:
            p2p.wait(works, self._where(msg, "sending"))
        if training:
            self.peak_activations, self.events, self.step_start = st.peak, st.events, start
        return torch.stack(st.losses).mean() if has_last else None

    def _plan(self, s: Schedule, training: bool) -> list[tuple]:
        """This rank's issue plan for ``s`` (:meth:`Schedule.issue_plan`): with communication
        behind compute, a pair's send right after its F and receives ``recv_ahead`` batches
        early; in the strict model (``overlap=False``) every message where the schedule has
        it."""
        key = (s.name, training)
        if key not in self._plans:
            self._plans[key] = s.issue_plan(self.rank, pairs=training, early=self._early_ok,
                                            recv_ahead=self.recv_ahead if self.overlap else 0)
        return self._plans[key]

    def _declared(self, s: Schedule, xs) -> dict:
        """The receive buffers' (shape, dtype) from the declared activation: no message."""
        meta = {}
        for c in range(s.virtual_stages):
            idx = s.stage_index(self.rank, c)
            meta[("in", idx)] = (xs[0].shape, xs[0].dtype) if idx == 0 else self.activation
            meta[("out", idx)] = self.activation
        return meta

    def _split_batch(self, t, needed: bool, code: int):
        if not needed:
            return None, None
        m = self.schedule.num_microbatches
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None, (code, ())
        if t.shape[0] % m:
            return None, (code + 1, (t.shape[0], m))
        return list(t.split(t.shape[0] // m)), None

    # -- compute ------------------------------------------------------------------------------
    def _forward(self, st: _Step, a) -> None:
        s = self.schedule.stage_index(self.rank, a.chunk)
        if s == 0:
            x = st.xs[a.microbatch]
        else:
            x = self._take(st, ("F", a.microbatch, s))
            x.requires_grad_(x.is_floating_point())
        last = s == self.schedule.num_stages - 1
        args = (x, st.ts[a.microbatch]) if last and self.stage_loss else (x,)
        captured, key = None, (a.microbatch, a.chunk)
        kw = {} if st.docs is None else {"docs": st.docs[a.microbatch]}
        if self._split is not None:     # a full backward needs only the layer cuts
            leaves, _, cuts = self._split[a.chunk]
            with Capture([] if key in self._full else leaves, cuts) as captured:
                y = self.stages[a.chunk](*args, **kw)
        else:
            y = self.stages[a.chunk](*args, **kw)
        if self.activation is not None and s < self.schedule.num_stages - 1 and \
                (y.shape, y.dtype) != self.activation:
            raise ValueError(f"pipeline stage {s} (pp rank {self.rank}): its output is "
                             f"{tuple(y.shape)} {y.dtype}, the declared activation "
                             f"{tuple(self.activation[0])} {self.activation[1]}")
        if last:
            loss = y if self.stage_loss else self.loss_fn(y, st.ts[a.microbatch])
            st.losses.append(loss.detach())
            y = loss / self.schedule.num_microbatches
        elif self._local(a.chunk, "SEND_F"):    # the next stage is on this rank: no message
            st.recvs[("F", a.microbatch, s + 1)] = (y.detach(), [])
            if not st.keep:                     # forward only: done with it
                return
        st.live[(a.microbatch, a.chunk)] = _Live(x, y, captured)
        st.peak = max(st.peak, len(st.live))

    def _local(self, chunk: int, kind: str) -> bool:
        """Whether ``kind``'s neighbour stage of ``chunk`` is on this rank (a V's turn)."""
        nb = self.schedule.neighbour(self.rank, chunk, kind)
        return nb is not None and nb[0] == self.rank

    def _overlapped(self, st: _Step, f, b, send=None) -> None:
        """DualPipe's overlapped pair: ``f``'s forward and ``b``'s backward as two coroutines
        taking turns at their transfers' waits (:func:`fastpar.mesh.fill.pair`): each one's
        all-to-alls travel while the other computes. ``send``: ``f``'s output's send, posted as
        soon as ``f`` has run (the next stage's F starts while this rank runs ``b``)."""
        if self.schedule.stage_index(self.rank, f.chunk) == 0:
            st.arrived = time.perf_counter()    # F takes no input: the pair starts now

        def forward():
            self._forward(st, f)
            if send is not None:
                with span("pipeline", send):
                    self._post(st, [send])
        if self._points.get(("F", f.chunk)) == 0 and self._points.get(("B", b.chunk)) == 0:
            forward()                           # no fill point on either side (seen alone):
            t = time.perf_counter()             # nothing to take turns at
            self._backward(st, b)
            st.filled = time.perf_counter() - t
            return
        st.filled = fill.pair(forward, lambda: self._backward(st, b))[1]

    def _backward(self, st: _Step, a) -> None:
        fill.drain(self._backward_steps(st, a))

    def _backward_steps(self, st: _Step, a):
        """B as a generator: one step per layer of a split backward (one step otherwise)."""
        s = self.schedule.stage_index(self.rank, a.chunk)
        key = (a.microbatch, a.chunk)
        live = st.live[key]
        grad = None if s == self.schedule.num_stages - 1 else self._take(st, ("B", a.microbatch, s))
        x = live.x
        if self._split is None:
            torch.autograd.backward(live.out, grad)
            dx = x.grad
            del st.live[key]                    # frees this micro-batch's activations
        else:
            dx, live.pending = yield from backward_input_steps(
                live.out, grad, x, live.captured, self._split[a.chunk][1],
                full=(a.microbatch, a.chunk) in self._full)
            live.x, live.out, live.captured = None, None, None    # W needs only `pending`
            if self.grads_set is not None and key not in self._full:
                # What B set by hand: all but W's parameters (a full one: none, autograd did).
                late = {id(p) for _, _, params in live.pending for p in params}
                self.grads_set(a.chunk, [p for p in self.stages[a.chunk].parameters()
                                         if p.grad is not None and id(p) not in late])
        if s > 0:
            dx = dx if dx is not None else torch.zeros_like(x)
            if self._local(a.chunk, "SEND_B"):  # the previous stage is on this rank
                st.recvs[("B", a.microbatch, s - 1)] = (dx, [])
            else:
                st.grads[key] = dx

    def _weight(self, st: _Step, a) -> None:
        backward_weight(st.live.pop((a.microbatch, a.chunk)).pending)

    # -- communication ------------------------------------------------------------------------
    def _post(self, st: _Step, batch) -> None:
        s, ops, msgs = self.schedule, [], []
        for a in batch:
            msg = s.message(self.rank, a)
            peer = self._peers[s.peer(self.rank, a)]
            tag = p2p.message_tag(*msg, s.num_stages)
            if a.kind == "SEND_F":
                live = st.live[(a.microbatch, a.chunk)] if st.keep else \
                    st.live.pop((a.microbatch, a.chunk))        # forward only: done with it
                t = live.out.detach().contiguous()
            elif a.kind == "SEND_B":
                t = st.grads.pop((a.microbatch, a.chunk)).contiguous()
            else:
                shape, dtype = self._meta[("in" if a.kind == "RECV_F" else "out", msg[2])]
                t = torch.empty(shape, dtype=dtype, device=self.device)
            op = dist.isend if a.kind.startswith("SEND") else dist.irecv
            ops.append(dist.P2POp(op, t, peer, self.pp_group, tag))
            msgs.append(msg)
        posted = p2p.post(ops, self._stream)
        for op, msg, works in zip(ops, msgs, posted):
            send = op.op is dist.isend
            if not self.overlap:                # a gloo work must be waited on only once
                p2p.wait(works, self._where(msg, "sending" if send else "receiving"))
                works = []
            if send:
                st.sends.append((works, op.tensor, msg))
            else:
                st.recvs[msg] = (op.tensor, works)

    def _take(self, st: _Step, msg) -> torch.Tensor:
        buf, works = st.recvs.pop(msg)
        p2p.wait(works, self._where(msg, "receiving"))
        if st.arrived is None:                  # (a pair's B takes its input inside the F)
            st.arrived = time.perf_counter()
        return buf

    def _where(self, msg, doing: str) -> str:
        """'pipeline stage 1 (pp rank 1) receiving <message> from stage 0 (pp rank 0, ...)'."""
        kind, m, receiver = msg
        sender = receiver - 1 if kind == "F" else receiver + 1
        here, there = (receiver, sender) if doing == "receiving" else (sender, receiver)
        peer = self.schedule.place(there)[0]
        return (f"pipeline stage {here} (pp rank {self.rank}) {doing} "
                f"{p2p.describe(kind, m, receiver)} {'from' if doing == 'receiving' else 'to'} "
                f"stage {there} (pp rank {peer}, global rank {self._peers[peer]})")
