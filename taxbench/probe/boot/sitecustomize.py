"""taxbench's probe, loaded at interpreter start by every Python process of a `taxbench run -- COMMAND` run.

`taxbench run` puts this folder first on PYTHONPATH and the run's probe settings in TAXBENCH_PROBE. Python imports one
module named sitecustomize, so this one chains the next sitecustomize on the path (the user's or the distribution's)
by file. It imports nothing of taxbench or torch itself: it waits for the command to import torch, and activates the
probe (taxbench.probe.runtime) the moment that import finishes, before any user code runs a torch op.
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_next_sitecustomize() -> None:
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_taxbench_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


def _activate() -> None:
    """Start the probe; a probe that cannot start leaves its reason in the run folder (taxbench run reports it and
    the run is no evidence) and never stops the user's command."""
    settings = os.environ["TAXBENCH_PROBE"]
    try:
        extra = os.environ.get("TAXBENCH_PROBE_PATH")
        if extra and extra not in sys.path:
            sys.path.append(extra)  # where taxbench is, for a command whose interpreter would not find it
        from taxbench.probe.runtime import activate

        activate(settings)
    except Exception as exc:  # noqa: BLE001 (any failure: reported, never raised into the user's program)
        reason = f"{type(exc).__name__}: {exc}"
        print(f"taxbench probe: not started in process {os.getpid()}: {reason}", file=sys.stderr)
        try:
            folder = os.path.join(os.path.dirname(settings), "probe")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"failed.{os.getpid()}"), "w", encoding="utf-8") as handle:
                handle.write(reason + "\n")
        except OSError:
            pass


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of `torch` so that the probe activates once torch has loaded."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (the importlib protocol)
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            original(module)
            _activate()

        loader.exec_module = exec_module
        return spec


def _install() -> None:
    if not os.environ.get("TAXBENCH_PROBE"):
        return
    if "torch" in sys.modules:
        _activate()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


_chain_next_sitecustomize()
_install()
