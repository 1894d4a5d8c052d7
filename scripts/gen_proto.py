#!/usr/bin/env python3
"""Regenerate the Python gRPC code of the pdserve API.

    python scripts/gen_proto.py            # regenerate pdserve_api/ from proto/
    python scripts/gen_proto.py --check    # exit 1 listing stale files, write nothing

Inputs: every ``*.proto`` under ``proto/`` (today ``proto/pdserve_api/v1/*.proto``,
proto package ``pdserve.v1``). Output: the top-level package ``pdserve_api/``
(``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py`` plus empty ``__init__.py`` files),
produced with

    python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. <protos>

run from the repository root with repository-relative proto paths, so the output does not
depend on where the checkout lives. ``pdserve_api/`` holds generated code only: a regen
removes any ``.py``/``.pyi`` file there that protoc did not produce.

Reproducibility: protoc output is deterministic for a given grpcio-tools release, but the
generated files embed that release (protobuf gencode version header and runtime check,
``GRPC_GENERATED_VERSION`` in ``*_pb2_grpc.py``). The committed code is generated with
grpcio-tools == GRPCIO_TOOLS_VERSION below; install exactly that version to regenerate or
check (``pip install grpcio-tools==1.85.1``). With another version both modes refuse to run
unless ``--allow-version-mismatch`` is given (then ``--check`` compares anyway and will
most likely report every file as stale). Bump the pin together with a regen commit.
Note that the generated ``*_pb2_grpc.py`` files require grpcio >= GRPCIO_TOOLS_VERSION at
import time, and the ``*_pb2.py`` files a protobuf runtime at least as new as the gencode.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# grpcio-tools release the committed pdserve_api/ code was generated with (pinned).
GRPCIO_TOOLS_VERSION = "1.85.1"

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR_NAME = "proto"
PACKAGE_NAME = "pdserve_api"
GENERATED_SUFFIXES = (".py", ".pyi")


def installed_grpcio_tools_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return None


def find_protos(repo_root: Path = REPO_ROOT) -> list[str]:
    """Repository-relative paths (from proto/) of every .proto, sorted."""
    proto_dir = repo_root / PROTO_DIR_NAME
    return sorted(p.relative_to(proto_dir).as_posix() for p in proto_dir.rglob("*.proto"))


def generate(out_root: Path, repo_root: Path = REPO_ROOT) -> list[str]:
    """Generate the package into ``out_root/pdserve_api``; return the relative files written.

    ``out_root`` must be empty of a previous ``pdserve_api`` (a fresh temp dir).
    """
    protos = find_protos(repo_root)
    if not protos:
        raise SystemExit(f"no .proto files under {repo_root / PROTO_DIR_NAME}")
    out_root = Path(out_root).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR_NAME}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *[f"{PROTO_DIR_NAME}/{p}" for p in protos],
    ]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"protoc failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    pkg = out_root / PACKAGE_NAME
    if not pkg.is_dir():
        raise SystemExit(f"protoc produced no {PACKAGE_NAME}/ package (check proto paths)")
    # Every directory of the package becomes a regular package with an empty __init__.py.
    for d in [pkg, *sorted(p for p in pkg.rglob("*") if p.is_dir())]:
        init = d / "__init__.py"
        if not init.exists():
            init.write_bytes(b"")
    return list_package_files(out_root)


def list_package_files(root: Path) -> list[str]:
    """Relative paths (from ``root``) of the .py/.pyi files in ``root/pdserve_api``."""
    pkg = Path(root) / PACKAGE_NAME
    if not pkg.is_dir():
        return []
    return sorted(
        p.relative_to(root).as_posix()
        for p in pkg.rglob("*")
        if p.is_file() and p.suffix in GENERATED_SUFFIXES and "__pycache__" not in p.parts
    )


def compare(fresh_root: Path, target_root: Path) -> list[str]:
    """Differences between freshly generated code and the code under ``target_root``.

    Returns human-readable lines ``"stale: path"``, ``"missing: path"``, ``"extra: path"``;
    empty when the trees match byte for byte.
    """
    fresh = set(list_package_files(fresh_root))
    target = set(list_package_files(target_root))
    problems = []
    for rel in sorted(fresh | target):
        if rel not in target:
            problems.append(f"missing: {rel}")
        elif rel not in fresh:
            problems.append(f"extra: {rel}")
        elif not filecmp.cmp(Path(fresh_root) / rel, Path(target_root) / rel, shallow=False):
            problems.append(f"stale: {rel}")
    return problems


def sync(fresh_root: Path, target_root: Path) -> list[str]:
    """Make ``target_root/pdserve_api`` equal to the fresh tree; return the actions taken."""
    actions = []
    for line in compare(fresh_root, target_root):
        kind, rel = line.split(": ", 1)
        dst = Path(target_root) / rel
        if kind == "extra":
            dst.unlink()
            actions.append(f"removed {rel}")
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(fresh_root) / rel, dst)
            actions.append(f"{'wrote' if kind == 'missing' else 'updated'} {rel}")
    # Drop directories left empty (apart from __pycache__) by removed protos.
    pkg = Path(target_root) / PACKAGE_NAME
    for d in sorted((p for p in pkg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if d.name != "__pycache__" and not any(c.name != "__pycache__" for c in d.iterdir()):
            shutil.rmtree(d)
            actions.append(f"removed {d.relative_to(target_root).as_posix()}/")
    return actions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="regenerate into a temp dir and exit 1 listing stale files; write nothing"
    )
    ap.add_argument(
        "--target",
        type=Path,
        default=REPO_ROOT,
        help="directory holding the pdserve_api/ package to update or check (default: the repository root)",
    )
    ap.add_argument(
        "--allow-version-mismatch", action="store_true", help=f"run even if grpcio-tools is not {GRPCIO_TOOLS_VERSION}"
    )
    args = ap.parse_args(argv)

    installed = installed_grpcio_tools_version()
    if installed != GRPCIO_TOOLS_VERSION:
        msg = (
            f"grpcio-tools {installed or '(not installed)'} is installed but the committed code "
            f"is generated with grpcio-tools=={GRPCIO_TOOLS_VERSION} "
            f"(pip install grpcio-tools=={GRPCIO_TOOLS_VERSION})"
        )
        if not args.allow_version_mismatch:
            print(f"error: {msg}; pass --allow-version-mismatch to run anyway", file=sys.stderr)
            return 2
        print(f"warning: {msg}", file=sys.stderr)

    target = args.target.resolve()
    with tempfile.TemporaryDirectory(prefix="pdserve_gen_proto_") as tmp:
        generate(Path(tmp))
        if args.check:
            problems = compare(Path(tmp), target)
            if problems:
                print(
                    f"{PACKAGE_NAME}/ is out of date with {PROTO_DIR_NAME}/; run: python scripts/gen_proto.py",
                    file=sys.stderr,
                )
                for line in problems:
                    print(f"  {line}", file=sys.stderr)
                return 1
            print(f"{PACKAGE_NAME}/ is up to date ({len(list_package_files(target))} files)")
            return 0
        actions = sync(Path(tmp), target)
    for a in actions:
        print(a)
    print(f"{PACKAGE_NAME}/ regenerated ({len(list_package_files(target))} files, {len(actions)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
