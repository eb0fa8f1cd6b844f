"""``fastpar train`` on one machine without torchrun: torch's elastic launcher starts the ranks
and restarts failed workers up to ``max_restarts`` times; a restarted run resumes from the last
complete checkpoint. Under torchrun (RANK is set) the command just runs this rank.

Everything listens on loopback only: the rendezvous store and the workers' store are bound to
127.0.0.1 (torch's own TCPStore binds every interface unless handed a bound socket), the
workers' MASTER_ADDR is 127.0.0.1, and gloo uses the loopback interface unless
GLOO_SOCKET_IFNAME says otherwise. A multi-node job is torchrun's, with the address given there.

A worker that fails for a reason fastpar names (a bad input, a stuck collective, non-finite
steps) prints one line and exits 1; when no restart is left the launcher prints which ranks
failed and how, and exits 1 (``SystemExit``), with no traceback. A rank that stalled is ended
by its watchdog (exit code ``STALL_EXIT``) after every rank dumped its flight record; the
launcher then prints one more line, where the records first differ
(:func:`fastpar.mesh.flight_report.first_divergence`).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import fields, replace
from pathlib import Path

from .host import worker_env
from .config import TrainConfig
from ..mesh.layout import Layout

_RDZV = "fastpar-loopback"


def _worker(cfg: TrainConfig, layout: Layout | None = None) -> None:
    from .trainer import train

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # A restarted worker continues (from scratch if no checkpoint was written yet).
        cfg = replace(cfg, resume=cfg.resume or "auto")
    train(cfg, layout)


def _spawned_worker(cfg: TrainConfig, layout: Layout) -> None:
    """A rank started by the launcher: a named failure is one line on stderr and exit code 1;
    Ctrl-C and SIGTERM end it at once and silently, by their default action (the launcher says
    what happened; checkpoints are written under a temporary name, so the last complete one
    stays intact). The rank started with SIGINT ignored (:func:`_children_ignore_sigint`)."""
    from .trainer import CLEAR_ERRORS

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        _worker(cfg, layout)
    except CLEAR_ERRORS as e:
        print(f"fastpar train: error: rank {os.environ.get('RANK', '?')}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        os._exit(130)           # no teardown: its threads and progress bar would print
    # Done, and the agent takes the (empty) result before the process exits. By the time exit
    # handlers run, the process's threads are joined and its files closed, so the rank leaves
    # at once instead of tearing down an interpreter holding torch (over a second a run).
    atexit.register(_leave)


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _children_ignore_sigint():
    """Ranks started inside start with SIGINT ignored, so that a Ctrl-C while they import torch
    prints no tracebacks (each takes SIGINT back once it runs fastpar's code, and the launcher
    stops them with SIGTERM). An ignored signal is the one disposition that survives the
    spawn's fork and exec (the spawn clears a blocked mask), so the ranks' Python is started
    through a two-line shell script that ignores SIGINT and execs it."""
    import multiprocessing
    import shlex
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fastpar-launch-") as tmp:
        exe = Path(tmp) / "python"
        exe.write_text(f"#!/bin/sh\ntrap '' INT\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        exe.chmod(0o755)
        multiprocessing.set_executable(str(exe))
        try:
            yield
        finally:
            multiprocessing.set_executable(sys.executable)


def interrupted(cfg: TrainConfig, signum: int = signal.SIGINT) -> str:
    """The one line for a run stopped by Ctrl-C (or SIGTERM): the step reached and how to go
    on."""
    import json
    from pathlib import Path

    from .checkpoint import latest_checkpoint

    how = "terminated" if signum == signal.SIGTERM else "interrupted"
    out = Path(cfg.out)
    step = 0
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        step = json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        pass
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None:
        return (f"fastpar train: {how} after step {step} of {cfg.steps}; no checkpoint was "
                f"written, so a new run starts over (--save-every N writes one every N steps)")
    return (f"fastpar train: {how} after step {step} of {cfg.steps}; the last complete "
            f"checkpoint is {ckpt}: continue with the same options and "
            f"--out {cfg.out} --resume")


def _loopback_store():
    """A TCPStore server that accepts connections on 127.0.0.1 only."""
    from torch.distributed import TCPStore

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                    wait_for_workers=False, master_listen_fd=sock.detach())


def _loopback_handler(params):
    """torch's c10d rendezvous, with both of its stores on loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
        C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import \
        DynamicRendezvousHandler, create_handler

    class LoopbackHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):
            return _loopback_store()

        def next_rendezvous(self):
            # A fresh workers' store each round: a restarted group must not find the keys
            # (gloo's peer addresses) of the round that failed.
            self._shared_tcp_store_server = self._bootstrap_store_info = None
            return super().next_rendezvous()

        def get_backend(self) -> str:
            return _RDZV

    store = _loopback_store()
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = LoopbackHandler     # the same object; only the store server differs
    return handler


def _loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def _describe(failures: dict, max_restarts: int) -> str:
    from ..mesh.watchdog import STALL_EXIT

    parts = []
    for rank, f in sorted(failures.items()):
        how = (f"was killed by {f.signal_name()}" if f.exitcode < 0 else
               f"was ended by its watchdog (code {STALL_EXIT}: no progress for --timeout)"
               if f.exitcode == STALL_EXIT else f"exited with code {f.exitcode}")
        parts.append(f"rank {rank} {how}")
    restarts = f"after {max_restarts} restart(s)" if max_restarts else "no restarts allowed"
    return (f"the job failed ({restarts}, --max-restarts {max_restarts}): {'; '.join(parts)}; "
            f"the ranks' own messages are above")


def hang_line(out, failures: dict, run_id: str | None, world: int) -> str | None:
    """The line that says where the ranks' flight records first differ, when a rank of the
    failed job was ended by its watchdog (else None); reads ``out``'s dumps of run ``run_id``."""
    from ..mesh.flight import read_dumps
    from ..mesh.flight_report import first_divergence
    from ..mesh.watchdog import STALL_EXIT, dump_dir

    if not any(f.exitcode == STALL_EXIT for f in failures.values()):
        return None
    folder = dump_dir(out)
    return (f"fastpar train: {first_divergence(read_dumps(folder, run_id), world)}; "
            f"records: {folder}/rank*.json")


def check_inputs(cfg: TrainConfig, world: int, local_ranks: int) -> Layout:
    """Every check of what a run is given, before anything is created or any rank starts (and
    on every rank under torchrun): the layout, the data (each split it reads), the weights of
    ``--init-from`` (every shard present and complete, shapes against the layout) and whether
    the layout fits in memory (the planner's estimate per rank, unless ``--no-memory-check``).
    Returns the run's layout, which the ranks use as it is. Raises ValueError (one line)."""
    from ..data.sources import check_data
    from .init_from import check_source
    from .memory_check import check_memory

    lay = cfg.check_layout(world)
    for split in ("train", "val") if cfg.eval_every else ("train",):
        check_data(cfg.data, cfg.seq_len, cfg.model_config.vocab_size, cfg.model, split)
    if cfg.init_from:
        check_source(cfg.init_from, cfg.tp, cfg.pp)
    if not cfg.no_memory_check:
        check_memory(cfg, lay, local_ranks)
    return lay


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0) -> None:
    """Run ``cfg`` on ``nproc`` local ranks (checks the configuration first, in this process).
    A failed job raises ``SystemExit(1)`` after printing one line (see the module doc)."""
    from .outdir import check_out, prepare_out, resolve_out
    from .trainer import check_resume

    spawn = "RANK" not in os.environ and nproc > 1
    world = nproc if spawn else int(os.environ.get("WORLD_SIZE", "1"))
    lay = check_inputs(cfg, world, nproc if spawn else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if not spawn:                       # one process, or a torchrun rank: train() does the rest
        cfg = resolve_out(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        try:
            _worker(cfg, lay)
        except KeyboardInterrupt as e:     # Ctrl-C, or SIGTERM (fastpar.cli.Terminated)
            signum = getattr(e, "signum", signal.SIGINT)
            if int(os.environ.get("RANK", "0")) == 0:
                print(interrupted(cfg, signum), file=sys.stderr, flush=True)
            raise SystemExit(128 + signum) from None
        return
    # Here, once, before any rank starts: the checkpoint to resume from (with every file's
    # sha256, and that it continues the run), then the run's folder (a fresh one, or an
    # earlier run moved aside by --overwrite).
    cfg = resolve_out(cfg, 1)
    check_out(cfg)
    check_resume(cfg, full=True)
    cfg = prepare_out(cfg)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous_handler_registry.register(_RDZV, _loopback_handler)
    # The spawned workers inherit these: gloo on loopback, the cores shared out among the
    # ranks rather than each rank's threads fighting for all of them (as torchrun does), and
    # an allocator that keeps freed memory (fastpar.train.host).
    lo = _loopback_interface()
    if lo and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    os.environ.update(worker_env(nproc))
    # Ctrl-C stays a KeyboardInterrupt here rather than the agent's SignalException: the agent
    # then stops the ranks with SIGTERM, which ends a rank at once even while it starts up
    # (when it still ignores SIGINT), instead of passing SIGINT on.
    agent_signals = {"signals_to_handle": "SIGTERM,SIGHUP,SIGQUIT"} \
        if "signals_to_handle" in {f.name for f in fields(LaunchConfig)} else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"fastpar-{uuid.uuid4().hex[:8]}", rdzv_backend=_RDZV,
                          rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1",
                          **agent_signals)
    # The agent's own warnings (a worker shut down, a signal received) would repeat what the
    # one line below says; torch sets a level on each of its loggers, so each is quietened.
    # So would the traceback of each failed worker, and the SIGTERM sent to the others.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # Workers leave with os._exit (see _spawned_worker), which the resource tracker would report
    # as leaked semaphores when the job ends.
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [
        os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker:UserWarning"]))
    try:
        with _children_ignore_sigint():
            elastic_launch(config, _spawned_worker)(cfg, lay)
    except ChildFailedError as e:
        signum = _stopped_by(e.failures)
        if signum:                      # the ranks were stopped from outside, not failed
            print(interrupted(cfg, signum), file=sys.stderr, flush=True)
            raise SystemExit(128 + signum) from None
        print(f"fastpar train: error: {_describe(e.failures, max_restarts)}", file=sys.stderr,
              flush=True)
        line = hang_line(cfg.out, e.failures, config.run_id, nproc)
        if line:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except (KeyboardInterrupt, SignalException) as e:
        signum = int(getattr(e, "sigval", getattr(e, "signum", signal.SIGINT)))
        print(interrupted(cfg, signum), file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None


def _stopped_by(failures: dict) -> int | None:
    """SIGINT or SIGTERM when every failed rank died of that signal, else None."""
    signals = {-f.exitcode if f.exitcode < 0 else f.exitcode - 128 for f in failures.values()}
    return signals.pop() if len(signals) == 1 and signals <= {signal.SIGINT,
                                                               signal.SIGTERM} else None
