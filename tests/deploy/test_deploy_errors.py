"""Each offline check fails on a deliberate error: a broken compose file, a Dockerfile with a lint error, broken
values files (schema and parallel config), and manifests with a wrong field (built-in kinds and a custom resource,
both hand-written and mutated from the chart's own output)."""

from __future__ import annotations

from pathlib import Path

import yaml
from deploy_helpers import FIXTURES, REPO, checks, docs_of, find


def test_broken_compose_fails_compose_config(tools):
    r = checks.compose_config(tools, FIXTURES / "compose-broken.yaml")
    assert not r.ok
    assert "portz" in r.output or "interval" in r.output, r.output


def test_broken_compose_fails_compose_spec_schema(tools):
    r = checks.compose_schema(tools, FIXTURES / "compose-broken.yaml")
    assert not r.ok
    assert "portz" in r.output, r.output


def test_mutated_real_compose_fails(tools, tmp_path):
    # The real file with one wrong value: the published port given as a mapping Compose does not accept.
    data = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    data["services"]["decode"]["shm_size"] = {"size": "2gb"}
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(data))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "pdserve.yaml").write_text("{}\n")
    assert not checks.compose_config(tools, bad).ok
    assert not checks.compose_schema(tools, bad).ok


def test_dockerfile_with_root_user_fails_hadolint(tools, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text((REPO / "docker" / "Dockerfile").read_text() + "USER root\n")
    r = checks.hadolint(tools, bad)
    assert not r.ok
    assert "DL3002" in r.output, r.output  # Last USER should not be root


def test_dockerfile_with_unpinned_pip_install_fails_hadolint(tools, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        (REPO / "docker" / "Dockerfile")
        .read_text()
        .replace("USER 10001:10001", "RUN pip install requests\nUSER 10001:10001")
    )
    r = checks.hadolint(tools, bad)
    assert not r.ok
    assert "DL3013" in r.output, r.output


def test_values_with_a_typo_fail_lint_and_template(tools, render):
    values = [FIXTURES / "values-broken-typo.yaml"]
    lint = checks.helm_lint(tools, values)
    assert not lint.ok
    tpl = render(values)
    assert not tpl.ok
    assert "tensorParalelSize" in tpl.output, tpl.output


def test_values_with_a_wrong_type_fail(render):
    r = render(sets=["decode.tensorParallelSize=two"])
    assert not r.ok
    assert "tensorParallelSize" in r.output, r.output


def test_values_with_a_refused_parallel_config_fail_template(tools, render):
    # helm lint runs templates in lint mode, where `fail` is only logged (Helm's documented lint behaviour): the
    # refusal shows in its output, and `helm template` (which CI runs too) fails on it.
    values = [FIXTURES / "values-broken-dcp.yaml"]
    lint = checks.helm_lint(tools, values)
    assert "invalid parallel config" in lint.output, lint.output
    tpl = render(values)
    assert not tpl.ok
    assert "decode: invalid parallel config" in tpl.output, tpl.output


def test_hand_written_manifests_with_wrong_fields_fail(tools):
    text = (FIXTURES / "manifest-wrong-field.yaml").read_text()
    r = checks.k8s_validate(tools, text, "fixture")
    assert not r.ok
    assert "3 invalid manifest(s)" in r.output, r.output
    assert "'replica' was unexpected" in r.output
    assert "fifty thousand" in r.output
    assert "'periodSecond' was unexpected" in r.output


def _mutate_and_validate(tools, manifests: str, kind: str, mutate) -> "checks.Result":
    docs = docs_of(manifests)
    target = find(docs, kind)
    assert target, f"no {kind} rendered"
    mutate(target[0])
    return checks.k8s_validate(tools, yaml.safe_dump_all(docs), f"mutated {kind}")


def test_rendered_chart_with_a_wrong_field_fails(tools, render):
    ex = REPO / "deploy" / "helm" / "examples" / "multi-node.yaml"
    out = render([ex], api_versions=checks.EXAMPLE_API_VERSIONS["multi-node"])
    assert out.ok, out.output

    def deployment(d):
        d["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # should be "resources"

    def lws(d):
        d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3

    def servicemonitor(d):
        d["spec"]["endpoints"][0]["intervall"] = "15s"

    def pdb(d):
        d["spec"]["maxUnavailable"] = {"pods": 1}

    for kind, fn in (
        ("Deployment", deployment),
        ("LeaderWorkerSet", lws),
        ("ServiceMonitor", servicemonitor),
        ("PodDisruptionBudget", pdb),
    ):
        r = _mutate_and_validate(tools, out.output, kind, fn)
        assert not r.ok, f"{kind}: {r.output}"
        assert "1 invalid manifest(s)" in r.output, r.output


def test_unknown_kinds_are_errors_not_skipped(tools):
    doc = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    r = checks.k8s_validate(tools, yaml.safe_dump(doc), "unknown kind")
    assert not r.ok
    assert "no schema" in r.output, r.output


def test_fixtures_exist():
    for name in (
        "compose-broken.yaml",
        "values-broken-typo.yaml",
        "values-broken-dcp.yaml",
        "manifest-wrong-field.yaml",
    ):
        assert Path(FIXTURES / name).is_file(), name
