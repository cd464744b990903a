"""`python -m taxbench` and the `taxbench` console script."""

import sys
from importlib.util import find_spec
from pathlib import Path

import taxbench

# conf/, launchers/ and analysis/ live beside taxbench/ in a checkout; the installed package maps them inside it.
MAPPED = ("taxbench.conf", "taxbench.launchers", "taxbench.analysis")


def shadowing_folder() -> str | None:
    """The folder imported as `taxbench` when it is not the whole installed package (`python -m` puts the current
    folder first on sys.path, so a clone's `taxbench/` shadows the installed one), else None. Whole: the mapped
    packages lie inside it (installed) or beside it (an editable install of this checkout)."""
    folder = Path(next(iter(taxbench.__path__), "taxbench"))
    if getattr(taxbench, "__file__", None) is None:
        return str(folder)
    for name in MAPPED:
        spec = find_spec(name)
        where = [Path(path).parent for path in (spec.submodule_search_locations or [])] if spec else []
        if not where or where[0] not in (folder, folder.parent):
            return str(folder)
    return None


if (shadow := shadowing_folder()) is not None:
    print(f"taxbench: error: {shadow} is imported as the taxbench package but is not the installed package (a "
          "`taxbench` folder in the current folder shadows it); run taxbench from another folder, or install this "
          "checkout with `pip install -e .`", file=sys.stderr)
    raise SystemExit(2)  # taxbench.exit_codes.CONFIG_ERROR, which a shadowing folder may not provide

from taxbench.cli import main  # noqa: E402  (after the check: a shadowed package fails on import)

if __name__ == "__main__":
    main()
