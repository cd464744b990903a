"""Fixtures the tests share; the helpers themselves live in tests/helpers.py."""

from __future__ import annotations

import pytest
from helpers import run_taxbench


@pytest.fixture
def taxbench_cli():
    return run_taxbench
