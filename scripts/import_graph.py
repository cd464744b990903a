#!/usr/bin/env python3
"""The import picture of taxbench as it is installed, and the checks that keep it layered.

`launchers/`, `analysis/` and `conf/` live at the top of the repository but ship inside the package
(pyproject's `package-dir`), so a graph of the `taxbench/` folder alone misses them. This lays the installed shape out
as symlinks in a temporary folder, per that mapping, and then
- prints the subpackage-level picture (`--picture`): one line per subpackage with what it imports;
- checks (`--check`, the default): import-linter's contracts in pyproject.toml ([tool.importlinter]: the core never
  imports analysis, launchers or the command line; analysis never imports launchers; the core's own layers), no
  import cycle between modules or subpackages, every taxbench module placed in a contract, and no function-local
  import of a taxbench module outside the command line (LAZY_IMPORTS_ALLOWED: taxbench/cli.py and the subcommands in
  taxbench/commands/ that import lazily to keep every `--help`, shell completion and `taxbench analyse` free of torch;
  anywhere else a local import would only hide a cycle), and no module outside taxbench/rundir/ that reads a run
  folder's format by a string (a manifest indexed by its field names, a step record's timing field named by a literal
  of its own) instead of through rundir's models.

Exit 0 when every check holds, 1 otherwise (naming each problem). Needs the `dev` extra (import-linter, grimp).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "taxbench"
# The only modules that import taxbench modules inside functions, each for the reason given: the command line's
# `taxbench analyse`, every --help and shell completion load neither torch nor a launcher (tests/test_cli.py).
LAZY_IMPORTS_ALLOWED = {
    "taxbench.cli": "imports a subcommand's module only when it runs",
    "taxbench.commands.experiment": "Hydra's completion and --cfg need no launcher; a local launch starts its fork "
                                    "server before torch is imported",
    "taxbench.commands.launch": "submitit is optional (taxbench[slurm]): a missing one is one line, exit 2",
    **dict.fromkeys(("taxbench.commands.layouts", "taxbench.commands.stacks", "taxbench.commands.scan_cli",
                     "taxbench.commands.verify_cli", "taxbench.commands.localize_cli", "taxbench.commands.certificate"),
                    "its --help loads no torch: the launchers and torch once the arguments are read"),
    "taxbench.commands.run": "its --help loads no torch: the launchers and torch once the arguments are read",
    "taxbench.probe.boot.sitecustomize": "runs at interpreter start in every process of a user's command (taxbench "
                                         "run): it imports the probe only once the command has imported torch",
    "taxbench.probe.runtime": "the tracing machinery loads into a user's command only in a replay of localize",
}


def package_dirs() -> dict[str, Path]:
    """Dotted package -> source folder, from pyproject's [tool.setuptools] package-dir."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


def lay_out(into: Path) -> Path:
    """The installed package as symlinks under `into` (the root package's files, then each mapped subpackage)."""
    dirs = package_dirs()
    root = into / PACKAGE
    root.mkdir()
    for entry in dirs[PACKAGE].iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name != PACKAGE:
            target = into / Path(*name.split("."))
            if not target.exists():
                target.symlink_to(folder)
    return into


def modules(tree_root: Path) -> dict[str, Path]:
    found = {}
    files = [Path(folder) / name for folder, _, names in os.walk(tree_root / PACKAGE, followlinks=True)
             for name in names if name.endswith(".py")]
    for path in sorted(files):
        parts = path.relative_to(tree_root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Direct imports between taxbench modules (a name imported from a package counts as its module when it is one),
    and the function-local ones outside LAZY_IMPORTS_ALLOWED, as problems."""
    edges: dict[str, set[str]] = defaultdict(set)
    problems = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        local_nodes = {id(sub) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                       for sub in ast.walk(fn)}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (base := _resolve(module, node)):
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            targets = [t for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")]
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target != module:
                    edges[module].add(target)
                if id(node) in local_nodes and module not in LAZY_IMPORTS_ALLOWED:
                    problems.append(f"{path.relative_to(path.parents[len(module.split('.')) - 1].parent)}:"
                                    f"{node.lineno}: function-local import of {target} (import it at the top; a "
                                    "cycle it would close is a layering problem)")
    return edges, problems


def subpackage(module: str) -> str:
    """taxbench.train.trainer -> taxbench.train; a top-level module is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(set(edges) | {n for targets in edges.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    grouped: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            if target != PACKAGE and subpackage(source) != subpackage(target):
                grouped[subpackage(source)].add(subpackage(target))
    return grouped


def contract_modules() -> set[str]:
    """Every module named by a contract in pyproject's [tool.importlinter]."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    named: set[str] = set()
    for contract in config["contracts"]:
        for key in ("source_modules", "forbidden_modules", "layers"):
            for entry in contract.get(key, []):
                named.update(part.strip() for part in entry.replace(":", "|").split("|"))
    return named


# The run folder's formats are read through taxbench/rundir/'s models only: outside it no module indexes a manifest
# by a string (manifest["config"], manifest.get("layout")) or names a step record's timing field by a string literal
# of its own (taxbench.rundir.step_record names them); a literal followed by ":" is a key of a result's own.
_FORMAT_OWNER = f"{PACKAGE}.rundir"
_STRING_INDEXED = re.compile(r"""\bmanifests?(\[[^\]]+\])?(\[\s*["']|\.get\(\s*["'])"""
                             r"""|["'](time_s|data_s|window_s|device_s|fingerprint_s|planted_s)["'](?!\s*:)""")


def string_indexed_formats(mods: dict[str, Path]) -> list[str]:
    """Lines outside taxbench/rundir/ that index a manifest or name a step record's timing field by a string."""
    found = []
    for module, path in sorted(mods.items()):
        if module == _FORMAT_OWNER or module.startswith(_FORMAT_OWNER + "."):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if _STRING_INDEXED.search(code):
                found.append(f"{module}:{number}: reads a run-folder format by a string ({code.strip()[:80]}); use "
                             "the model in taxbench/rundir/ (run_manifest.Manifest, step_record's names)")
    return found


def check(tree_root: Path, mods: dict[str, Path], edges: dict[str, set[str]], problems: list[str]) -> list[str]:
    problems = problems + string_indexed_formats(mods)
    named = contract_modules()
    for module in mods:
        if module != PACKAGE and module.count(".") >= 1 and subpackage(module) not in named:
            problems.append(f"{module}: in no import-linter contract of pyproject.toml; place {subpackage(module)} "
                            "in a layer")
    for component in cycles(edges):
        problems.append("import cycle between modules: " + " -> ".join(component))
    for component in cycles(package_edges(edges)):
        problems.append("import cycle between subpackages: " + " -> ".join(component))
    env = {**os.environ, "PYTHONPATH": str(tree_root)}
    linted = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()", str(REPO / "pyproject.toml"), "--no-cache"],
                            cwd=tree_root, env=env, capture_output=True, text=True)
    if linted.returncode != 0:
        problems.append("import-linter:\n" + (linted.stdout + linted.stderr).strip())
    return problems


def picture(edges: dict[str, set[str]]) -> str:
    grouped = package_edges(edges)
    nodes = sorted(set(grouped) | {t for targets in grouped.values() for t in targets})
    width = max(len(n) for n in nodes)
    return "\n".join(f"{n:<{width}} -> {', '.join(sorted(grouped.get(n, ()))) or '-'}" for n in nodes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--picture", action="store_true", help="print the subpackage-level import picture")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree_root = lay_out(Path(tmp))
        mods = modules(tree_root)
        edges, problems = imports(mods)
        if args.picture:
            print(picture(edges))
        problems = check(tree_root, mods, edges, problems)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"imports layered: {len(mods)} modules, no cycles, every contract kept")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
