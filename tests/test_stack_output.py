"""The training stacks' own chatter (DeepSpeed's prints and stdout logger, torchtitan's root-logger warnings, torch's
deprecation notices for the APIs they call) stays off stdout, which carries the verdict, and out of the ranks'
stderr; taxbench's own output is kept."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
from helpers import has_deepspeed

from taxbench.diagnostics import NAMESPACE, stacks_quieted


def _has_torchtitan() -> bool:
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:
        return False
    return True


def _warn_from(module: str, category: type[Warning]) -> None:
    exec(compile("warnings.warn('noise', category)", module, "exec"), {"__name__": module, "warnings": warnings,
                                                                        "category": category})


def test_a_stacks_warnings_and_root_logger_are_quieted_and_taxbench_keeps_its_own(
        caplog: pytest.LogCaptureFixture) -> None:
    root, ours = logging.getLogger(), logging.getLogger(NAMESPACE)
    before = root.level, ours.level, list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with stacks_quieted():
            for module in ("torch.distributed.c10d_logger", "deepspeed.runtime.zero", "torchtitan.distributed.utils"):
                _warn_from(module, FutureWarning)
                _warn_from(module, UserWarning)
            _warn_from("taxbench.train.trainer", UserWarning)
            _warn_from("my_models.factory", FutureWarning)  # the user's own code
            assert not root.isEnabledFor(logging.WARNING)  # torchtitan logs on the root logger itself
            assert ours.isEnabledFor(logging.WARNING)
    assert sorted(str(w.filename) for w in seen) == ["my_models.factory", "taxbench.train.trainer"]
    assert (root.level, ours.level, list(warnings.filters)) == before  # undone: an in-process rank ran in this one


def _first_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.strip()][:1]


@pytest.mark.slow
@pytest.mark.skipif(not has_deepspeed(), reason="needs taxbench[deepspeed]")
def test_deepspeed_says_nothing_on_stdout_before_the_verdict(tmp_path: Path, taxbench_cli) -> None:
    result = taxbench_cli("+recipe=deepspeed_moe_debug", f"experiment.out_dir={tmp_path}", "experiment.name=ds",
                          "experiment.steps=12", "experiment.block_steps=3", "experiment.warmup_steps=2",
                          "experiment.resume_step=6", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _first_lines(result.stdout)[0].startswith("ds  deepspeed_moe_debug"), result.stdout[:2000]
    assert "built successfully" not in result.stdout and "No existing process group" not in result.stdout
    assert "Warning" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not _has_torchtitan(), reason="needs taxbench[titan]")
def test_torchtitan_says_nothing_on_stdout_before_the_verdict(tmp_path: Path, taxbench_cli) -> None:
    result = taxbench_cli("+recipe=titan_llama3_debug", f"experiment.out_dir={tmp_path}", "experiment.name=tt",
                          "experiment.steps=12", "experiment.block_steps=3", "experiment.warmup_steps=2",
                          "experiment.resume_step=6", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _first_lines(result.stdout)[0].startswith("tt  titan_llama3_debug"), result.stdout[:2000]
    assert "Warning" not in result.stderr and "initial_load_model_only" not in result.stderr, result.stderr[-3000:]
