"""stop.json and commits.json (taxbench.rundir.stop_file): what a continue carries, across the versions of each."""

from __future__ import annotations

import json
import os
from pathlib import Path

from taxbench.rundir.stop_file import (
    CAP,
    COMMITS_FILE,
    STOP_FILE,
    TARGET,
    Stop,
    read_commits,
    read_stop,
    write_commits,
)


def test_a_stop_reads_back_as_written_and_one_of_another_version_or_damaged_is_none(tmp_path: Path) -> None:
    stop = Stop(steps=40, stopped_by=TARGET, half_width=0.004, commits=(10, 20, 30))
    stop.write(tmp_path)
    stored = json.loads((tmp_path / STOP_FILE).read_text())
    assert stored["format_version"] == 1 and "pairs" not in stored
    assert read_stop(tmp_path) == stop

    del stored["format_version"]  # every stop.json before the field was of version 1
    (tmp_path / STOP_FILE).write_text(json.dumps(stored))
    assert read_stop(tmp_path) == stop

    for damaged in ({**stored, "format_version": 2}, {"stopped_by": CAP}, [40], "{"):
        (tmp_path / STOP_FILE).write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        assert read_stop(tmp_path) is None, damaged  # the rounds run again from their newest checkpoint


def test_commits_carry_up_to_the_resumed_step_in_either_version_and_damage_leaves_only_that_step(
        tmp_path: Path) -> None:
    write_commits(tmp_path, (4, 8, 12))
    assert json.loads((tmp_path / COMMITS_FILE).read_text()) == {"format_version": 1, "commits": [4, 8, 12]}
    assert read_commits(tmp_path, through=8) == (4, 8)

    (tmp_path / COMMITS_FILE).write_text("[4, 8, 12]")  # written before the file had a version
    assert read_commits(tmp_path, through=12) == (4, 8, 12)

    for damaged in ('{"format_version": 2, "commits": [4]}', '{"commits": [4]}', '["four"]', "[4, 8"):
        (tmp_path / COMMITS_FILE).write_text(damaged)
        assert read_commits(tmp_path, through=8) == (8,), damaged

    (tmp_path / COMMITS_FILE).unlink()
    os.mkfifo(tmp_path / COMMITS_FILE)  # not a regular file: refused unopened, never blocks the continue
    assert read_commits(tmp_path, through=6) == (6,)
