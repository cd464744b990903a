"""Bad input stops before any rank starts: exit 2, one line naming the key, the value and the fix, nothing left behind.

Most checks run in-process through `taxbench.preflight.prepare` (what the CLI calls before launching); the CLI tests
check the exit code, the single line and the untouched out_dir for a sample of each kind of error.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import compose_config

from taxbench.config.schema import ConfigError

FACTORY = "++recipe.model.factory={_target_: torch.nn.Embedding, num_embeddings: 256, embedding_dim: %d}"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["recipe.model.kind=custom"], "recipe.model.kind=custom needs recipe.model.factory"),
        (["recipe.model.kind=custom", "++recipe.model.factory={_target_: no_such_pkg.build}"],
         "recipe.model.factory._target_='no_such_pkg.build' could not be instantiated"),
        (["recipe.model.n_heads=0"], "recipe.model.n_heads=0 must be >= 1"),
        (["recipe.precision=fp8"], "recipe.precision=fp8 "),  # CPU: no float8 matmuls (or no torchao)
        (["recipe.model.vocab_size=0"], "recipe.model.vocab_size=0 must be >= 1"),
        (["recipe.model.d_model=0"], "recipe.model.d_model=0 must be >= 1"),
        (["recipe.parallel.ep=2"], "recipe.parallel.ep=2 needs an MoE model, but recipe.model.kind=dense; set "
         "recipe.parallel.ep=1"),
        (["+recipe=moe_1t_proxy", "recipe.parallel.pp=1", "recipe.model.kind=dense"],
         "recipe.parallel.ep=2 needs an MoE model, but recipe.model.kind=dense"),
        (["+recipe=moe_1t_proxy", "recipe.parallel.pp=1", "recipe.model.kind=custom", FACTORY % 256],
         "recipe.parallel.ep=2 needs an MoE model, but recipe.model.kind=custom"),
        (["recipe.model.kind=custom", FACTORY % 256, "recipe.parallel.tp=2"],
         "recipe.parallel.tp=2 shards taxbench's attention and MLP blocks, and recipe.model.factory._target_="
         "'torch.nn.Embedding' (Embedding) has none; set recipe.parallel.tp=1"),
        (["cluster.master_port=99999"], "cluster.master_port=99999 must be a TCP port"),
        (["experiment.name=../../x"], "experiment.name='../../x' must be a plain folder name"),
        (["experiment.name=/tmp/elsewhere"], "experiment.name='/tmp/elsewhere' must be a plain folder name"),
        (["experiment.name=."], "experiment.name='.' must be a plain folder name"),
        (["experiment.name="], "experiment.name='' must be a plain folder name"),
        (["experiment.steps=99999999999999999999"], "experiment.steps=99999999999999999999 makes a run of "
         "99999999999999999999 steps, more than the 1000000 one run may take"),
        (["experiment.steps=200000", "experiment.target_half_width=0.005"],
         "experiment.max_steps=0 (10 x experiment.steps) makes a run of 2000000 steps, more than the 1000000"),
        (["experiment.profile_steps=1000000"], "experiment.profile_steps=1000000 makes a run of 1000006 steps"),
        (["recipe.model.kind=custom", FACTORY % 100], "returns logits of shape [4, 64, 100]"),
        (["recipe.model.kind=custom", "++recipe.model.factory={_target_: torch.nn.Linear, in_features: 3, "
          "out_features: 4}"], "the forward pass on a [4, 64] token batch failed"),
        (["recipe.model.kind=custom", "++recipe.model.factory={_target_: torch.nn.LSTM, input_size: 4, "
          "hidden_size: 4}"], "the forward pass on a [4, 64] token batch failed"),
        (["experiment.fault.enabled=true", "experiment.fault.kind=nondeterministic_op",
          "experiment.fault.module=blocks.1.ffn", "experiment.fault.op=aten.matmull.default"],
         "experiment.fault.op='aten.matmull.default' matches no ATen op"),
        (["experiment.fault.enabled=true", "experiment.fault.kind=nondeterministic_op",
          "experiment.fault.module=blocks.7.ffn", "experiment.fault.op=aten.mm.default"],
         "experiment.fault.module='blocks.7.ffn' is not a module"),
        (["experiment.trace.enabled=true", "experiment.trace.modules=[blockz.*]"],
         "experiment.trace.modules: 'blockz.*' matches no module"),
        (["experiment.trace.enabled=true", "experiment.trace.ops=[aten.nosuch*]"],
         "experiment.trace.ops: 'aten.nosuch*' matches no ATen op"),
    ],
)
def test_bad_input_is_refused_before_launch(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        compose_config(*overrides)
    assert expected in str(excinfo.value)


def test_good_custom_model_and_fault_pass_preflight() -> None:
    compose_config("recipe.model.kind=custom", FACTORY % 256)
    compose_config("experiment.fault.enabled=true", "experiment.fault.kind=nondeterministic_op",
                   "experiment.fault.module=blocks.1.ffn", "experiment.fault.op=aten.mm.default")
    compose_config("experiment.trace.enabled=true", "experiment.trace.ops=[aten.index_put_*]",
                   "experiment.trace.modules=[blocks.1.*]")


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_first() -> None:
    with pytest.raises(ConfigError, match="cluster.device=cuda but this machine has no usable CUDA GPU"):
        compose_config("cluster.device=cuda")


def test_out_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    for out_dir, expected in ((file, "is a file, not a folder"), (file / "below", "is a file, not a folder")):
        with pytest.raises(ConfigError, match=expected):
            compose_config(f"experiment.out_dir={out_dir}")


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A real read-only file system (root ignores permission bits, so chmod would prove nothing)."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    yield target
    subprocess.run(["umount", str(target)], check=False)


def test_read_only_out_dir_is_refused(read_only_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not writable"):
        compose_config(f"experiment.out_dir={read_only_dir / 'runs'}")


def test_shard_tokens_beyond_the_vocabulary_are_refused_before_launch(tmp_path: Path, taxbench_cli) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 64)
    assert taxbench_cli("build-shards", str(text), str(tmp_path / "shards"), cwd=tmp_path).returncode == 0
    with pytest.raises(ConfigError, match=r"token ids reach 255 .* recipe.model.vocab_size=100"):
        compose_config("recipe.data.kind=shards", f"recipe.data.path={tmp_path / 'shards'}",
                       "recipe.model.vocab_size=100")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["experiment.stepz=3"], "experiment.stepz is not a config key; did you mean experiment.steps?"),
        (["+experiment.stepz=3"], "experiment.stepz is not a config key; did you mean experiment.steps?"),
        (["recipe.model.n_layer=3"], "did you mean recipe.model.n_layers?"),
        (["experiment.steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
        (["recipe.precision=fp16"], "Invalid value 'fp16', expected one of [fp32, bf16, fp8]"),
        (["+recipe=nosuch"], "available options in 'recipe': deepspeed_dense_debug, deepspeed_moe_debug, dense_tiny"),
        (["cluster=nope"], "available options in 'cluster': inprocess, local"),
        (["mode@arms.baseline=nope"], "available options in 'mode': baseline, deterministic"),
        (["recipe.model.kind=nosuch"], "expected one of [dense, moe, custom, titan, megatron, deepspeed]"),
        (["recipe.model.n_heads=0"], "recipe.model.n_heads=0 must be >= 1"),
        (["experiment.name=../escape"], "must be a plain folder name"),
        (["experiment.steps=99999999999999999999"], "more than the 1000000 one run may take (the schedule draws every "
         "round's order before the first step"),
        (["reprot", "runs/x"], "did you mean `taxbench report`?"),
        (["+recipe=moe_1t_proxy", "recipe.parallel.pp=1", "recipe.model.kind=dense"],
         "recipe.parallel.ep=2 needs an MoE model, but recipe.model.kind=dense; set recipe.parallel.ep=1"),
    ],
)
def test_cli_config_errors_exit_2_with_one_line_and_leave_nothing(
    taxbench_cli, tmp_path: Path, args: list[str], expected: str
) -> None:
    out_dir = tmp_path / "runs"
    result = taxbench_cli(*args, f"experiment.out_dir={out_dir}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("taxbench: error: "), result.stderr
    assert expected in lines[0]
    assert not out_dir.exists() and not (tmp_path.parent / "escape").exists()


BROKEN_RECIPES = {
    "flow": ("model: {kind: dense\n", "flow.yaml is not valid YAML: while parsing a flow mapping at line 3"),
    "quote": ('seed: "0\n', "quote.yaml is not valid YAML: while scanning a quoted scalar at line 3"),
    "indent": ("model:\n  kind: dense\n   vocab_size: 3\n", "indent.yaml is not valid YAML: mapping values are not "
               "allowed here at line 5"),
    "typo": ("modle:\n  kind: dense\n", "In 'recipe/typo': recipe.modle is not a config key; did you mean "
             "recipe.model?"),
}


@pytest.mark.parametrize("name", list(BROKEN_RECIPES))
def test_config_file_errors_exit_2_with_one_line(taxbench_cli, tmp_path: Path, name: str) -> None:
    body, expected = BROKEN_RECIPES[name]
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / f"{name}.yaml").write_text(
        f"defaults: [/schema/recipe@_here_]\nname: {name}\n{body}")
    result = taxbench_cli(f"+recipe={name}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", cwd=tmp_path,
                          timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("taxbench: error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert expected in result.stderr


def test_a_search_path_that_does_not_exist_exits_2_with_one_line(taxbench_cli, tmp_path: Path) -> None:
    """Hydra only warns and composes without it, so a recipe kept there would silently not be the one that runs."""
    result = taxbench_cli(f"hydra.searchpath=[file://{tmp_path / 'nosuch'}]", "plan=true", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"taxbench: error: hydra.searchpath: {tmp_path / 'nosuch'} is neither an existing folder "
                             "nor an importable package; give a folder as file:///absolute/path or a package as "
                             "pkg://module\n")
