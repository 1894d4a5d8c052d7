"""The offline CI checks of issue #8 pass on the repository's files: compose file against Compose and the
compose-spec schema, Dockerfile through hadolint, and the Helm chart (lint, template, strict Kubernetes schemas) for
its default values and every example values file."""

from __future__ import annotations

import pytest
from deploy_helpers import REPO, checks, docs_of


def _ok(result) -> None:
    assert result.ok, str(result)


def test_compose_config(tools):
    _ok(checks.compose_config(tools))


def test_compose_spec_schema(tools):
    _ok(checks.compose_schema(tools))


def test_compose_with_the_tls_overlay(tools):
    _ok(checks.compose_config(tools, (checks.COMPOSE_FILE, checks.COMPOSE_TLS_FILE)))
    _ok(checks.compose_schema(tools, checks.COMPOSE_TLS_FILE))
    assert any("compose.tls.yaml" in r.name for r in checks.check_compose(tools))


def test_hadolint(tools):
    _ok(checks.hadolint(tools))


def test_values_schema_is_a_valid_json_schema(tools):
    _ok(checks.values_metaschema(tools))


def test_examples_present():
    names = {p.stem for p in checks.examples()}
    assert {"cpu-dev", "gpu-1node", "multi-node", "mtls"} <= names, names


@pytest.mark.parametrize("example", [None, "cpu-dev", "gpu-1node", "multi-node", "mtls"])
def test_helm_lint_template_and_kubernetes_schemas(tools, render, example):
    values = [] if example is None else [REPO / "deploy" / "helm" / "examples" / f"{example}.yaml"]
    _ok(checks.helm_lint(tools, values))
    rendered = render(values, api_versions=checks.EXAMPLE_API_VERSIONS.get(example or "", ()))
    _ok(rendered)
    assert len(docs_of(rendered.output)) >= 8
    result = checks.k8s_validate(tools, rendered.output, example or "default")
    _ok(result)
    assert "0 invalid manifest(s)" in result.output


def test_checks_script_lists_its_checks():
    assert set(checks.CHECKS) == {"compose", "dockerfile", "helm"}
