"""Local launchers: ranks as processes on this machine (gloo on CPU, NCCL on GPU), or one rank in-process.

Spawned ranks die with their launcher (a SIGKILLed launcher must not leave ranks writing into the experiment), and a
rank that dies or raises ends the launch with `RankFailed`: one line naming the rank and how to continue.

Rank processes are forked from a fork server that has imported torch and the rank's code once (multiprocessing's
"forkserver" start method with those modules preloaded) instead of each rank importing them again after a spawn: on a
CPU node the ranks' imports were the largest part of the startup. The server is a fresh process that never touched a
device, so a rank may still initialise CUDA. A rank gets the launcher's environment and working directory as they
are at the launch, not as they were when the server started; what a library read from the environment when the server
imported it (OMP_NUM_THREADS by OpenMP, TORCH_* at torch's import) is the first launch's (the worker sets torch's
thread count itself).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.multiprocessing as mp

from taxbench.checkpoint.store import CheckpointError
from taxbench.config.schema import TaxbenchConfig, world_size
from taxbench.diagnostics import NAMESPACE, logger
from taxbench.launchers.rank_server import start_rank_server
from taxbench.launchers.worker import run_rank
from taxbench.parallel.distributed import free_port
from taxbench.rundir.records import RunWriteError
from taxbench.schedule.cost import STARTED_ENV, process_start_unix

log = logger(__name__)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Overrides that the continue command sets itself (with or without Hydra's + / ++ prefixes).
_CONTINUE_KEYS = ("experiment.name", "experiment.continue_existing")
_PLAIN_HYDRA_VALUE = re.compile(r"[\w.\-]+")


class RankFailed(RuntimeError):
    """A rank process died or raised; the message names the rank and the command that continues the experiment
    (`what`: the failure alone, for a caller that words its own way to continue)."""

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = what or message


def die_with_parent(launcher_pid: int) -> None:
    """SIGKILL this process as soon as the launcher is gone (Linux; elsewhere nothing is done).

    torch's spawn asks for SIGINT on its parent's death instead, which a rank ignores when the launcher was started
    with SIGINT ignored (a script's background job) and which a rank blocked in a collective does not act on. A rank
    forked by the fork server is not the launcher's child, and it holds the server open (the server lives while any
    of its clients does), so it watches the launcher's process itself (a pidfd, Linux 5.3+); without pidfds it asks
    the kernel to kill it when its parent dies (prctl), which is the launcher under spawn."""
    if not sys.platform.startswith("linux"):
        return
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before this rank started watching
        return
    except OSError:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != launcher_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_kill_self_when_readable, args=(launcher,), name="taxbench-launcher-watch",
                     daemon=True).start()


def _kill_self_when_readable(pidfd: int) -> None:
    select.select([pidfd], [], [])  # a pidfd turns readable when its process exits
    os.kill(os.getpid(), signal.SIGKILL)


# What a spawned rank runs: (rank, world size, local rank, config, experiment folder, master address, port).
RankMain = Callable[[int, int, int, TaxbenchConfig, str, str, int], None]


def _spawned(local_rank: int, launcher_pid: int, environment: dict[str, str], cwd: str, log_level: int, world: int,
             cfg: TaxbenchConfig, root: str, addr: str, port: int, rank_main: RankMain) -> None:
    die_with_parent(launcher_pid)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    logging.getLogger(NAMESPACE).setLevel(log_level)  # the launcher's, e.g. DEBUG under hydra.verbose=taxbench
    rank_main(local_rank, world, local_rank, cfg, root, addr, port)


_launches = 0  # launches this process has started: the first counts from the command's start, later ones from their own


def launch_started() -> float | None:
    """When this launch started, for the cost split: the command's start for the first launch of the process (its
    imports and config are the launch's startup), the moment of the launch for a later one (a multirun's next point,
    verify's next rerun)."""
    global _launches
    _launches += 1
    return process_start_unix() if _launches == 1 else time.time()


def start_ranks(cfg: TaxbenchConfig, root: Path, rank_main: RankMain = run_rank) -> None:
    """Run `rank_main` in a process per rank of the world and wait for them; RankFailed (what happened, one line)
    when one dies or raises."""
    world = world_size(cfg.cluster)
    addr = cfg.cluster.master_addr
    port = cfg.cluster.master_port or free_port(addr)
    # torch logs a warning per surviving rank it terminates after a failure; RankFailed already says what happened.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    log.debug("starting %d rank processes (gloo/NCCL rendezvous at %s:%d)", world, addr, port)
    environment = dict(os.environ)
    started = launch_started()
    if started is not None:  # the ranks' cost split counts from it (taxbench.schedule.cost.command_started_unix)
        environment[STARTED_ENV] = repr(started)
    method = start_rank_server()  # usually running already: the command line starts it before its own imports
    try:
        mp.start_processes(_spawned, args=(os.getpid(), environment, os.getcwd(),
                                           logging.getLogger(NAMESPACE).getEffectiveLevel(), world, cfg, str(root),
                                           addr, port, rank_main),
                           nprocs=world, join=True, start_method=method)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        raise RankFailed(rank_failure(exc)) from None


def launch_local(cfg: TaxbenchConfig, root: Path, rank_main: RankMain = run_rank) -> None:
    try:
        start_ranks(cfg, root, rank_main)
    except RankFailed as exc:
        raise rank_failed(str(exc), cfg.experiment.name) from None


def rank_failed(what: str, name: str) -> RankFailed:
    """RankFailed saying `what` happened and how to continue experiment `name` started by this process."""
    return RankFailed(f"{what}; continue the experiment with: {shlex.join(continue_command(sys.argv, name))}", what)


def rank_failure(exc: mp.ProcessExitedException | mp.ProcessRaisedException) -> str:
    """"rank R died (SIGKILL)", "rank R exited with code C" or "rank R failed: <the exception's last line>"."""
    if isinstance(exc, mp.ProcessExitedException):
        if exc.signal_name:
            return f"rank {exc.error_index} died ({exc.signal_name})"
        return f"rank {exc.error_index} exited with code {exc.exit_code}"
    lines = [line for line in exc.msg.splitlines() if line.strip()]
    return f"rank {exc.error_index} failed: {_without_own_type(lines[-1].strip()) if lines else 'unknown error'}"


def _without_own_type(line: str) -> str:
    """taxbench's own errors are written as one readable line; drop the "taxbench.x.SomeError: " prefix of those."""
    head, sep, rest = line.partition(": ")
    return rest if sep and head.startswith("taxbench.") else line


def continue_command(argv: Sequence[str], name: str) -> list[str]:
    """The command line (as argv words) that continues experiment `name` started by `argv` (sys.argv of the start):
    the same program and overrides, with experiment.name=<name> and experiment.continue_existing=true."""
    program = [_python(), "-m", "taxbench"] if Path(argv[0]).name == "__main__.py" else [argv[0]]
    overrides = [arg for arg in argv[1:] if arg.lstrip("+").split("=", 1)[0] not in _CONTINUE_KEYS]
    return [*program, *overrides, f"experiment.name={_hydra_value(name)}", "experiment.continue_existing=true"]


def _python() -> str:
    """"python" when that is this interpreter on PATH (same folder: a venv's python is a link out of it), else this
    interpreter's path."""
    found = shutil.which("python")
    if found and os.path.dirname(os.path.abspath(found)) == os.path.dirname(sys.executable) \
            and os.path.realpath(found) == os.path.realpath(sys.executable):
        return "python"
    return sys.executable


def _hydra_value(value: str) -> str:
    if _PLAIN_HYDRA_VALUE.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def launch_inprocess(cfg: TaxbenchConfig, root: Path, rank_main: RankMain = run_rank) -> None:
    addr = cfg.cluster.master_addr
    started, before = launch_started(), os.environ.get(STARTED_ENV)
    if started is not None:  # the rank's cost split counts from this launch (a multirun's next point: not the first)
        os.environ[STARTED_ENV] = repr(started)
    try:
        rank_main(0, 1, 0, cfg, str(root), addr, cfg.cluster.master_port or free_port(addr))
    except (RunWriteError, CheckpointError) as exc:  # one-line errors of the run itself, as from a spawned rank
        raise rank_failed(f"rank 0 failed: {exc}", cfg.experiment.name) from None
    finally:
        if before is None:
            os.environ.pop(STARTED_ENV, None)
        else:
            os.environ[STARTED_ENV] = before
