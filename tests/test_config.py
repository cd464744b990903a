"""Config composition and validation: clear errors naming the key, the value and the fix; pairs refused with diff."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose_config

from taxbench.config.schema import ConfigError, Device, Precision


def test_embedded_default_is_dense_tiny_on_two_cpu_ranks() -> None:
    cfg = compose_config()
    assert cfg.recipe.name == "dense_tiny"
    assert cfg.cluster.device is Device.cpu and cfg.cluster.cpu_ranks == 2
    assert cfg.recipe.precision is Precision.fp32
    assert cfg.arms["baseline"].deterministic is False and cfg.arms["deterministic"].deterministic is True
    assert cfg.arms["deterministic"].cublas_workspace_config in (":4096:8", ":16:8")


def test_explicit_recipe_selection_replaces_the_default() -> None:
    cfg = compose_config("+recipe=dense_tiny", "recipe.model.d_model=32", "recipe.model.n_heads=2")
    assert cfg.recipe.model.d_model == 32


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["experiment.steps=61", "experiment.block_steps=6"],
         "experiment.steps=61 is not a multiple of experiment.block_steps=6"),
        (["recipe.global_batch_size=6"], "recipe.global_batch_size=6 is not divisible by micro_batch_size*dp"),
        (["experiment.resume_step=60"], "experiment.resume_step=60 must be in [1, experiment.steps=60) so that steps "
         "remain after the resume to compare; e.g. experiment.resume_step=30"),
        (["recipe.model.n_heads=3"], "recipe.model.d_model=64 is not divisible by recipe.model.n_heads=3"),
        (["mode@arms.baseline=deterministic"], "the baseline arm must be nondeterministic"),
    ],
)
def test_cross_field_errors_name_key_and_value(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        compose_config(*overrides)
    assert expected in str(excinfo.value)


def test_pair_differing_beyond_policy_is_refused_with_the_diff() -> None:
    with pytest.raises(ConfigError) as excinfo:
        compose_config("+arm_overrides.deterministic.recipe.micro_batch_size=2",
                       "+arm_overrides.deterministic.recipe.precision=bf16")
    message = str(excinfo.value)
    assert "refusing the pair" in message
    assert "recipe.micro_batch_size: baseline=4 deterministic=2" in message
    assert "recipe.precision: baseline='fp32' deterministic='bf16'" in message


def test_override_that_changes_nothing_is_accepted() -> None:
    cfg = compose_config("+arm_overrides.deterministic.recipe.micro_batch_size=4")
    assert cfg.recipe.micro_batch_size == 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["+recipe=no_such_recipe"], "no_such_recipe"),
        (["experiment.steps=many"], "experiment.steps"),
        (["recipe.precision=fp16"], "fp16"),
        (["+recipe.bogus=1"], "bogus"),
        (["experiment.block_steps=7"], "experiment.steps=60 is not a multiple of experiment.block_steps=7"),
        (["+arm_overrides.baseline.cluster.cpu_ranks=4"], "cluster.cpu_ranks: baseline=4 deterministic=2"),
    ],
)
def test_cli_reports_bad_config_without_a_traceback(
    taxbench_cli, tmp_path: Path, args: list[str], expected: str
) -> None:
    result = taxbench_cli(*args, f"experiment.out_dir={tmp_path}", cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.glob("*/deterministic-0")), "nothing may run on a bad config"


def test_cli_lists_allowed_values_for_enums(taxbench_cli, tmp_path: Path) -> None:
    result = taxbench_cli("recipe.precision=fp16", cwd=tmp_path, timeout=120)
    assert "fp32" in result.stderr and "bf16" in result.stderr and "fp8" in result.stderr


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_with_fsdp_is_refused_because_its_last_stage_went_untrained(schedule: str) -> None:
    with pytest.raises(ConfigError, match=f"{schedule} with recipe.parallel.data_parallel=fsdp leaves the last stage "
                                          "untrained"):
        compose_config("+recipe=moe_1t_proxy", f"recipe.parallel.pp_schedule={schedule}",
                       "recipe.parallel.virtual_stages=2", "experiment.name=x")


@pytest.mark.parametrize(("overrides", "resume_step"), [
    ((), 20),  # the default run: steps to spare after step 20
    (("experiment.steps=20",), 10),  # a short run resumes halfway instead of being refused
    (("experiment.steps=60", "experiment.gate_steps=16"), 8),  # half the gate runs' steps
    (("experiment.steps=20", "experiment.resume_step=5"), 5),  # a chosen step is kept
])
def test_the_default_resume_step_leaves_steps_to_compare(overrides: tuple[str, ...], resume_step: int) -> None:
    assert compose_config(*overrides).experiment.resume_step == resume_step


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("experiment.name='a\nb'", "experiment.name='a\\nb' holds the control character '\\n'"),
        ("experiment.name='a\tb'", "experiment.name='a\\tb' holds the control character '\\t'"),
        ("experiment.name='a\x1b[31mb'", "experiment.name='a\\x1b[31mb' holds the control character '\\x1b'"),
        # NaN equals nothing, not even itself: it used to read as a pair mismatch blaming arm_overrides nobody gave.
        ("recipe.optimizer.lr=nan", "recipe.optimizer.lr=nan is not a number"),
        ("experiment.conclusive_half_width=nan", "experiment.conclusive_half_width=nan is not a number"),
        ("recipe.optimizer.lr=inf", "recipe.optimizer.lr=inf must be a finite number"),
        ("recipe.optimizer.lr=-0.1", "recipe.optimizer.lr=-0.1 must be > 0"),
        ("recipe.optimizer.beta2=1", "recipe.optimizer.beta2=1.0 must be in [0, 1)"),
        ("recipe.optimizer.eps=0", "recipe.optimizer.eps=0.0 must be > 0"),
        ("recipe.optimizer.grad_clip=-1", "recipe.optimizer.grad_clip=-1.0 must be >= 0 (0: no clipping)"),
    ],
)
def test_a_bad_value_is_refused_as_itself(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        compose_config(override)
    assert str(excinfo.value).startswith(expected), str(excinfo.value)
    assert "arm_overrides" not in str(excinfo.value)


def test_a_newline_in_the_experiment_name_is_refused_before_any_folder_exists(tmp_path: Path, taxbench_cli) -> None:
    result = taxbench_cli("experiment.name='a\nb'", "cluster=inprocess", f"experiment.out_dir={tmp_path / 'runs'}",
                          cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("taxbench: error: experiment.name='a\\nb' holds the control character '\\n'; use a name "
                             "of printable characters (letters, digits, '-', '_', '.')\n")
    assert not (tmp_path / "runs").exists()
