"""Bad input to a command as one line on stderr and exit 2 (or the exit code the error carries), never a traceback:
taxbench's own errors, and Hydra's, OmegaConf's and YAML's multi-line messages translated to one line each."""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import yaml
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from taxbench import exit_codes
from taxbench.config.schema import ConfigError, unknown_key_message


def fail(message: str, code: int = exit_codes.CONFIG_ERROR) -> NoReturn:
    print(f"taxbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def fail_with(exc: Exception) -> NoReturn:
    """fail() with the exit code the error carries (taxbench.rundir.read.UnreadableRecords: 4), else 2."""
    fail(str(exc), getattr(exc, "exit_code", exit_codes.CONFIG_ERROR))


# Hydra and OmegaConf raise these for a bad override, an unknown config group option or a wrong type.
HYDRA_INPUT_ERRORS = (HydraException, OmegaConfBaseException)
# Hydra only warns about a search path that does not exist, then composes without it.
MISSING_SEARCHPATH = r"provider=hydra\.searchpath .*, path=(?P<path>.*) is not available\.?"
_UNKNOWN_KEY = re.compile(r"Key '[^']*' not in '[^']*'\s+full_key: (?P<key>\S+)")


@contextmanager
def one_line_input_errors(*more: type[Exception]) -> Iterator[None]:
    """Bad input to a command (ConfigError, `more`, Hydra's and YAML's errors, a missing search path): one line,
    exit 2 (or the code the error carries)."""
    warnings.filterwarnings("error", message=MISSING_SEARCHPATH, category=UserWarning)
    try:
        yield
    except (ConfigError, *more) as exc:
        fail_with(exc)
    except HYDRA_INPUT_ERRORS as exc:
        fail(config_error_line(exc))
    except yaml.YAMLError as exc:
        fail(yaml_error_line(exc))
    except UserWarning as exc:
        fail(searchpath_error_line(exc))


def config_error_line(exc: BaseException) -> str:
    """Hydra's multi-line message (and its OmegaConf cause) as one line, without the search-path and key noise."""
    full_text = "\n".join(str(error) for error in (exc, exc.__cause__) if error is not None)
    unknown = _UNKNOWN_KEY.search(full_text)
    if unknown:  # instead of Hydra's "To append to your config use +key=value": a typo is the likelier cause
        where = re.match(r"In '[^']+'", str(exc))
        return (f"{where.group(0)}: " if where else "") + unknown_key_message(unknown.group("key"))
    parts: list[str] = []
    for error in (exc, exc.__cause__):
        options: list[str] | None = None
        for line in (line.strip() for line in str(error or "").splitlines()):
            if not line or line.startswith(("full_key:", "object_type=", "reference_type=", "Set the environment")):
                continue
            if line.startswith("Config search path"):
                break
            if options is not None:
                options.append(line)
            elif line.startswith("Available options in"):
                options = []
                parts.append(line.rstrip(":").lower())
            else:
                parts.append(line.rstrip(".:"))
        if options:
            parts[-1] += ": " + ", ".join(options)
    return "; ".join(dict.fromkeys(parts)) or type(exc).__name__


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML syntax error in a config file as one line: the file, where the construct began and what broke it."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"a config file is not valid YAML: {' '.join(str(exc).split())}"
    problem = exc.problem_mark
    context = (f"{exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}: "
               if exc.context and exc.context_mark else "")
    return (f"{problem.name} is not valid YAML: {context}{exc.problem} at line {problem.line + 1}, column "
            f"{problem.column + 1}; fix the file")


def searchpath_error_line(warning: UserWarning) -> str:
    path = re.match(MISSING_SEARCHPATH, str(warning))
    return (f"hydra.searchpath: {path.group('path') if path else warning} is neither an existing folder nor an "
            "importable package; give a folder as file:///absolute/path or a package as pkg://module")
