"""Fixtures for the deploy checks: the tools (installed by deploy/ci/install_tools.sh when missing, never skipped)
and helm renders cached per session; the compose end-to-end figures in the terminal summary."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest
from deploy_helpers import checks


@pytest.fixture(scope="session")
def tools():
    """The deploy tools. Missing ones are installed by deploy/ci/install_tools.sh; if that fails the test fails
    with the script's output (a missing tool is an error here, not a reason to skip)."""
    try:
        return checks.ensure_tools(install=True)
    except checks.ToolError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def render(tools) -> Callable[..., "checks.Result"]:
    """render(values=(), sets=(), api_versions=()) -> Result of `helm template`, cached for the session."""
    cache: dict[tuple, checks.Result] = {}

    def _render(values=(), sets=(), api_versions=()):
        key = (tuple(str(v) for v in values), tuple(sets), tuple(api_versions))
        if key not in cache:
            cache[key] = checks.helm_template(tools, [Path(v) for v in values], sets, api_versions)
        return cache[key]

    return _render


def pytest_terminal_summary(terminalreporter):
    """The compose end-to-end figures (build, up, KV rates, restart), shown even under -q: a passing test's
    captured output is not."""
    lines = getattr(sys.modules.get("test_deploy_compose_engine"), "REPORT", [])
    if lines:
        terminalreporter.write_sep("-", "compose end to end")
        for line in lines:
            terminalreporter.write_line(f"compose e2e: {line}")
