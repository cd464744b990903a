"""The plans of the experiments that launch several: `taxbench layouts` (<root>/layouts.json: the layouts asked for
and how each one's launch went) and `taxbench stacks` (<root>/stacks.json: the cells asked for, what each ran, and why
a cell did not). The launchers write them (launchers/layouts.py, launchers/stacks.py) and analysis reads them back
(taxbench.analysis.layouts, taxbench.analysis.stacks_matrix): one model, one writer and one reader each, here.

Both carry `format_version` (PLANS_FORMAT); a plan without one is of version 1, as every plan before the field was.
A plan of another version is refused as bad input (RecordError, exit 2, as a manifest of another schema version is),
and what is not a plan at all as damaged evidence (UnreadableRecords, exit 4).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from taxbench.rundir.json_object import RecordError, UnreadableRecords, read_json_object
from taxbench.rundir.write_scope import write_result

LAYOUTS_PLAN_FILE = "layouts.json"
STACKS_PLAN_FILE = "stacks.json"
PLANS_FORMAT = 1
NOT_INSTALLED, NEEDS_CUDA = "not installed", "needs CUDA"
SKIPPED = (NOT_INSTALLED, NEEDS_CUDA)
STACK_NAMES = ("taxbench", "titan", "megatron", "deepspeed")  # a cell's stack, as the table and its folder name it
# The deterministic arm's mode (conf/mode/) per policy column, and how the table names it
POLICY_LABELS = {"stack_native": "own switch", "deterministic": "taxbench's policy"}


def _read_plan(path: Path, what: str) -> dict:
    stored = read_json_object(path, what)
    version = stored.pop("format_version", 1)
    if version != PLANS_FORMAT:
        raise RecordError(f"{path}: a {what} of format_version={version!r}, expected {PLANS_FORMAT}")
    return stored


# --------------------------------------------------------------------------------------------- the layouts plan
@dataclass
class LaunchRecord:
    seconds: float | None = None  # wall-clock time of the layout's two runs (process start to exit)
    failure: str | None = None  # a rank that died or raised, one line


@dataclass
class LayoutsPlan:
    recipe: str
    arm: str
    steps: int
    world_size: int
    layouts: list[str]
    launches: dict[str, LaunchRecord] = field(default_factory=dict)

    def write(self, root: Path) -> None:
        write_result(root / LAYOUTS_PLAN_FILE, json.dumps({"format_version": PLANS_FORMAT, **asdict(self)}, indent=2))


def read_layouts_plan(root: Path) -> LayoutsPlan:
    stored = _read_plan(root / LAYOUTS_PLAN_FILE, "layouts record")
    try:
        launches = {name: LaunchRecord(**value) for name, value in stored.get("launches", {}).items()}
        plan = LayoutsPlan(str(stored["recipe"]), str(stored["arm"]), int(stored["steps"]),
                           int(stored["world_size"]), [str(n) for n in stored["layouts"]], launches)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableRecords(f"{root / LAYOUTS_PLAN_FILE}: not a layouts record ({exc}); the file is "
                                "damaged") from exc
    if len(set(plan.layouts)) < 2 or len(set(plan.layouts)) != len(plan.layouts):
        raise UnreadableRecords(f"{root / LAYOUTS_PLAN_FILE}: layouts {plan.layouts} are not two or more distinct "
                                "layouts; the file is damaged or edited")
    return plan


def is_layouts_folder(root: Path) -> bool:
    return (root / LAYOUTS_PLAN_FILE).is_file()


# ---------------------------------------------------------------------------------------------- the stacks plan
@dataclass
class Cell:
    stack: str  # the stack's short name: one of STACK_NAMES
    policy: str  # the deterministic arm's mode: stack_native or deterministic
    recipe: str
    parameters: int | None  # the recipe's model on the meta device (None: the stack is not installed)
    skipped: str | None = None  # one of SKIPPED; None: the cell runs
    reason: str = ""  # why it did not run, one line (the install line, the refusal)
    seconds: float | None = None  # wall-clock time of its experiment (launch to exit)
    failure: str | None = None  # a rank that died or raised, one line

    @property
    def name(self) -> str:
        """Its experiment's folder under the matrix root."""
        return f"{self.stack}-{self.policy}"


@dataclass
class StacksPlan:
    family: str  # dense or moe: which recipe each stack runs
    steps: int
    world_size: int
    device: str
    cells: list[Cell] = field(default_factory=list)
    shape: str = ""  # the model and batch fields given to every stack that builds its model from them

    def write(self, root: Path) -> None:
        write_result(root / STACKS_PLAN_FILE, json.dumps({"format_version": PLANS_FORMAT, **asdict(self)}, indent=2))


def read_stacks_plan(root: Path) -> StacksPlan:
    stored = _read_plan(root / STACKS_PLAN_FILE, "stacks record")
    try:
        cells = [Cell(**cell) for cell in stored["cells"]]
        plan = StacksPlan(str(stored["family"]), int(stored["steps"]), int(stored["world_size"]),
                          str(stored["device"]), cells, str(stored.get("shape", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableRecords(f"{root / STACKS_PLAN_FILE}: not a stacks record ({exc}); the file is damaged") from exc
    names = [cell.name for cell in plan.cells]
    wrong = [cell.name for cell in plan.cells if cell.skipped not in (None, *SKIPPED) or
             cell.policy not in POLICY_LABELS or cell.stack not in STACK_NAMES]
    if not names or len(set(names)) != len(names) or wrong:
        raise UnreadableRecords(f"{root / STACKS_PLAN_FILE}: cells {names} are not distinct stack-policy cells "
                                f"{'(' + ', '.join(wrong) + ')' if wrong else ''}; the file is damaged or edited")
    return plan


def is_stacks_folder(root: Path) -> bool:
    return (root / STACKS_PLAN_FILE).is_file()
