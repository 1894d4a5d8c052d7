"""Validate Kubernetes manifests against Kubernetes' own JSON schemas, strictly (unknown fields are errors).

    $TOOLS/venv/bin/python deploy/ci/k8s_validate.py [--kube-version 1.27 ...] FILE...   (FILE "-": stdin)

Runs in the deploy-tools venv (deploy/ci/install_tools.sh). Built-in kinds are checked with kubernetes-validate
(the PyPI package that bundles the Kubernetes OpenAPI schemas as JSON schemas, strict variant: additionalProperties
false everywhere). Custom resources the chart renders (ServiceMonitor, LeaderWorkerSet) are checked against the
hand-written strict schemas in deploy/ci/schemas/, whose pod templates and metadata refer to the same Kubernetes
definitions. A document of any other kind is an error: nothing passes unchecked.

Prints one line per document and problem; exit status 0 when every document passed for every version, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent / "schemas"
DEFAULT_VERSIONS = ("1.27", "1.37")


def _kv_version_dir(version: str) -> str:
    mm = kv_utils.major_minor(version)
    known = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == mm]
    if not known:
        raise SystemExit(f"kubernetes-validate {kv_utils.__version__} has no schemas for Kubernetes {version}")
    return f"v{known[-1]}-local-strict"


_registries: dict[str, Registry] = {}


def _registry(version: str) -> Registry:
    if version not in _registries:
        defs = kv_utils.schema_contents(f"kubernetes-json-schema/{_kv_version_dir(version)}/_definitions.json", version)
        _registries[version] = Resource.from_contents(defs) @ Registry()
    return _registries[version]


def _crd_schema(doc: dict) -> dict | None:
    group_version = str(doc.get("apiVersion", ""))
    if "/" not in group_version or "." not in group_version.split("/")[0]:
        return None
    group, ver = group_version.split("/", 1)
    path = SCHEMAS / f"{str(doc.get('kind', '')).lower()}-{group.split('.')[0]}-{ver}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _where(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top)"


def validate_doc(doc: dict, version: str) -> list[str]:
    """Problems of one manifest for one Kubernetes version (empty: valid)."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    crd = _crd_schema(doc)
    if crd is not None:
        validator = jsonschema.Draft202012Validator(crd, registry=_registry(version))
        return [f"{_where(e)}: {e.message}" for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path))]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}"]
    except kv_utils.SchemaNotFoundError as e:
        return [f"no schema: {e.message}"]
    return []


def load_docs(path: str) -> list[dict]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--kube-version",
        action="append",
        dest="versions",
        help=f"Kubernetes version to validate against (repeatable; default {' and '.join(DEFAULT_VERSIONS)})",
    )
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    versions = args.versions or list(DEFAULT_VERSIONS)
    failed = 0
    total = 0
    for f in args.files:
        try:
            docs = load_docs(f)
        except yaml.YAMLError as e:
            print(f"ERROR {f}: not YAML: {e}")
            failed += 1
            continue
        for doc in docs:
            total += 1
            meta = (doc.get("metadata") or {}) if isinstance(doc, dict) else {}
            name = f"{doc.get('kind', '?')}/{meta.get('name', '?')}" if isinstance(doc, dict) else "?"
            problems = [(v, msg) for v in versions for msg in validate_doc(doc, v)]
            if problems:
                failed += 1
                for v, msg in problems:
                    print(f"ERROR {f} {name} (Kubernetes {v}): {msg}")
            else:
                print(f"OK {f} {name} (Kubernetes {', '.join(versions)})")
    print(f"{total - failed} valid, {failed} invalid manifest(s)")
    return 1 if failed or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
