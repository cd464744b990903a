"""The fork server that local ranks are forked from, started as soon as a command knows that it will launch local
ranks.

The server imports torch and the rank's code once (multiprocessing's "forkserver" start method with those modules
preloaded; see taxbench.launchers.local). Started at the launch, its imports followed the launcher's own imports and
preflight; started before them, they overlap, so the ranks start sooner. This module imports no torch, so that the
command line can start the server before it imports anything heavy.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal

# Imported once by the fork server, so that a rank starts with them (its main and what it needs) already loaded.
# torch.use_deterministic_algorithms, which every rank calls as it builds its first run, imports torch._inductor.config
# and with it torch._dynamo: 1.1 s a rank on this 2-core machine, as long as the rest of a rank's imports.
PRELOADED = ["taxbench.launchers.local", "taxbench.launchers.worker", "torch._inductor.config"]


def start_method() -> str:
    """forkserver where a rank can watch the launcher through a pidfd (die_with_parent); spawn elsewhere (a kernel
    before 5.3, a seccomp profile that refuses pidfd_open), where the launcher is the rank's parent."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return "spawn"
    return "forkserver"


def start_rank_server() -> str:
    """Start the fork server in the background, where ranks are forked from one (a no-op once it runs); the start
    method the ranks use. The server stops when this process exits (it would otherwise finish its imports first)."""
    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOADED)  # read when the server starts
        multiprocessing.forkserver.ensure_running()
        _stop_at_exit()
    return method


@functools.cache
def _stop_at_exit() -> None:
    atexit.register(_stop_server)


def _stop_server() -> None:
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass  # gone already
