#!/usr/bin/env python3
"""pdserve container entrypoint: one role per container, configured by a mounted YAML file and the environment.

    pdserve-entrypoint router|prefill|decode|openai [EXTRA...]   start that service (exec: it replaces this process)
    pdserve-entrypoint check ROLE                                 only run the parallel-config check for ROLE
    pdserve-entrypoint print-args ROLE [EXTRA FLAGS...]           print the command line as JSON, start nothing
    pdserve-entrypoint healthcheck [ARGS...]                      same as pdserve-healthcheck
    pdserve-entrypoint ANY OTHER COMMAND...                       exec'd as given (`pdserve validate ...`, `bash`)

Settings, later ones win:
  1. built-in defaults per role: listen on 0.0.0.0, ports router 50051 / prefill 50052 / decode 50053 / openai 8000
     (the OpenAI-compatible HTTP front, router.openai_http), the SmolLM2 model baked into the image, and
     `router: router:50051` for the workers and the front;
  2. the YAML file $PDSERVE_CONFIG (default /etc/pdserve/pdserve.yaml; a missing file is fine): its `common:`
     mapping, then the mapping named after the role;
  3. environment variables PDSERVE_ARG_<KEY> (e.g. PDSERVE_ARG_TENSOR_PARALLEL_SIZE=2), read as YAML (`2` is a
     number, `true` a switch); an empty value is ignored (compose passes unset variables that way), `null` removes
     the key; PDSERVE_LOG_LEVEL sets log_level;
  4. extra flags on the command line, appended as given.
Each key becomes the service flag of the same name (`tensor_parallel_size: 2` -> `--tensor-parallel-size 2`;
`true` -> `--flag`, `false` and null -> nothing, a list -> the flag once per item). `model: default` is the SmolLM2
checkpoint converted into the image at build time.

Deployment plumbing (router, advertise_host, pod_id, metrics_port, cluster_token, log_level) is only passed to a
service whose command line has that flag (the entrypoint reads the service's argparse parser); otherwise it is
dropped with a warning, so one image and one config work while the services grow flags. Every other key is passed
as given: a misspelt key fails the service at startup, as it should.

Cluster token: PDSERVE_CLUSTER_TOKEN, or the contents of the file PDSERVE_CLUSTER_TOKEN_FILE (a mounted Secret),
is exported to the service as PDSERVE_CLUSTER_TOKEN and passed as --cluster-token where the service has that flag
(masked in the log line). TLS: PDSERVE_TLS_CERT_FILE / _KEY_FILE / _CA_FILE become --tls-cert-file / --tls-key-file
/ --tls-ca-file; a service without those flags is not started (exit 1) rather than serving plaintext.

Before a prefill or decode service starts, its parallel config is checked with pdserve's rules (the code behind
`pdserve validate`): a config the rules refuse exits with status 2 and the two lines `pdserve validate` prints,
before any rank is spawned. The role and port are written to $PDSERVE_RUN_DIR/health.json (default /tmp/pdserve)
for pdserve-healthcheck.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

ROLES: dict[str, str] = {
    "router": "router",
    "prefill": "prefill_svc",
    "decode": "decode_svc",
    "openai": "router.openai_http",
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "router": {"host": "0.0.0.0", "port": 50051, "model": "default"},
    "prefill": {"host": "0.0.0.0", "port": 50052, "model": "default", "router": "router:50051"},
    "decode": {"host": "0.0.0.0", "port": 50053, "model": "default", "router": "router:50051"},
    "openai": {"host": "0.0.0.0", "port": 8000, "router": "router:50051"},
}
# The module whose parser lists a role's flags (a package's __main__, or the module run with -m itself).
FLAGS_MODULE: dict[str, str] = {"openai": "router.openai_http"}
DEFAULT_CONFIG = "/etc/pdserve/pdserve.yaml"
ENV_PREFIX = "PDSERVE_ARG_"
# Passed only where the service has the flag (see the module doc).
OPTIONAL_KEYS = ("router", "advertise_host", "pod_id", "metrics_port", "cluster_token", "log_level")
TLS_ENV = {
    "tls_cert_file": "PDSERVE_TLS_CERT_FILE",
    "tls_key_file": "PDSERVE_TLS_KEY_FILE",
    "tls_ca_file": "PDSERVE_TLS_CA_FILE",
}
SECRET_FLAGS = ("--cluster-token",)
# Keys the parallel-config check reads, and the `pdserve validate` flag of each.
PARALLEL_KEYS: dict[str, str] = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "decode_context_parallel_size": "--decode-context-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "dcp_kv_cache_interleave_size": "--dcp-kv-cache-interleave-size",
    "block_size": "--block-size",
}
DECODE_ONLY = ("decode_context_parallel_size", "dcp_kv_cache_interleave_size")


class EntrypointError(Exception):
    """Bad configuration (exit status 1; the parallel-config refusal exits 2 instead)."""


def warn(msg: str) -> None:
    print(f"pdserve-entrypoint: warning: {msg}", file=sys.stderr, flush=True)


def _yaml_load(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def load_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    p = Path(path or DEFAULT_CONFIG)
    if not p.is_file():
        return {}
    data = _yaml_load(p.read_text(encoding="utf-8"))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EntrypointError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    for section, body in data.items():
        if section not in ("common", *ROLES):
            raise EntrypointError(f"{p}: unknown section {section!r} (use common, router, prefill, decode)")
        if body is not None and not isinstance(body, dict):
            raise EntrypointError(f"{p}: section {section!r} must be a mapping, got {type(body).__name__}")
    return data


def _norm_key(key: Any) -> str:
    return str(key).strip().lower().replace("-", "_")


def _token_from_env(env: Mapping[str, str]) -> str | None:
    if env.get("PDSERVE_CLUSTER_TOKEN"):
        return env["PDSERVE_CLUSTER_TOKEN"]
    path = env.get("PDSERVE_CLUSTER_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip() or None
        except OSError as e:
            raise EntrypointError(f"cannot read PDSERVE_CLUSTER_TOKEN_FILE {path}: {e}") from e
    return None


def resolve(role: str, config: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The settings of ``role``: defaults < YAML common < YAML role < environment."""
    if role not in ROLES:
        raise EntrypointError(f"unknown role {role!r} (use one of {', '.join(ROLES)})")
    out: dict[str, Any] = dict(DEFAULTS[role])
    if env.get("PDSERVE_LOG_LEVEL"):
        out["log_level"] = env["PDSERVE_LOG_LEVEL"].upper()
    for section in ("common", role):
        for k, v in (config.get(section) or {}).items():
            out[_norm_key(k)] = v
    for name, raw in sorted(env.items()):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX) and raw.strip():
            out[_norm_key(name[len(ENV_PREFIX) :])] = _yaml_load(raw)
    token = _token_from_env(env)
    if token and out.get("cluster_token") is None:
        out["cluster_token"] = token
    for key, var in TLS_ENV.items():
        if env.get(var):
            out[key] = env[var]
    if role != "decode":
        # DCP is a decode-side layout; a shared `common:` section may carry it, the other roles do not take it.
        for k in DECODE_ONLY:
            out.pop(k, None)
    if role == "router":
        out.pop("router", None)
    if role == "openai":
        # The front serves whatever the router's pods serve: a shared `common: model:` is not its setting.
        out.pop("model", None)
    return {k: v for k, v in out.items() if v is not None}


def resolve_model(settings: dict[str, Any]) -> dict[str, Any]:
    """``model: default`` -> the checkpoint converted into the image (PDSERVE_CACHE)."""
    if settings.get("model") == "default":
        from pdserve.default_model import ensure_default_model

        settings = dict(settings, model=str(ensure_default_model()))
    return settings


def service_flags(role: str) -> set[str] | None:
    """The long flags the role's ``python -m`` parser accepts, or None when it cannot be read."""
    try:
        mod = importlib.import_module(FLAGS_MODULE.get(role, ROLES[role] + ".__main__"))
    except Exception as e:  # any import problem: pass every key and let the service speak
        warn(f"cannot read {ROLES[role]}'s flags ({type(e).__name__}: {e}); passing every setting")
        return None
    for name in ("build_parser", "_parser", "parser", "make_parser"):
        fn = getattr(mod, name, None)
        if callable(fn):
            try:
                parser = fn()
                return {s for s in parser._option_string_actions if s.startswith("--")}
            except Exception as e:
                warn(f"cannot build {ROLES[role]}'s parser ({type(e).__name__}: {e}); passing every setting")
                return None
    return None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def fit_to_service(role: str, settings: Mapping[str, Any], flags: set[str] | None) -> dict[str, Any]:
    """Drop plumbing keys the service has no flag for (warning); refuse TLS the service cannot serve."""
    if flags is None:
        return dict(settings)
    out = dict(settings)
    for key in TLS_ENV:
        if key in out and _flag(key) not in flags:
            raise EntrypointError(
                f"TLS is configured ({TLS_ENV[key]}) but {ROLES[role]} has no {_flag(key)} flag: "
                "refusing to serve plaintext; disable TLS or use an image whose services support it"
            )
    for key in OPTIONAL_KEYS:
        if key in out and _flag(key) not in flags:
            out.pop(key)
            if key != "log_level":
                warn(f"{ROLES[role]} has no {_flag(key)} flag; {key} not passed")
    return out


def to_flags(settings: Mapping[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in settings.items():
        flag = _flag(key)
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                flags += [flag, _scalar(key, item)]
        else:
            flags += [flag, _scalar(key, value)]
    return flags


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        raise EntrypointError(f"setting {key!r}: expected a scalar, got {type(value).__name__}")
    return str(value)


def command(role: str, settings: Mapping[str, Any], extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", ROLES[role], *to_flags(settings), *extra]


def masked(argv: Sequence[str]) -> list[str]:
    return [("***" if i > 0 and argv[i - 1] in SECRET_FLAGS else a) for i, a in enumerate(argv)]


def service_env(env: Mapping[str, str]) -> dict[str, str]:
    """The service's environment: ours, plus PDSERVE_CLUSTER_TOKEN read from PDSERVE_CLUSTER_TOKEN_FILE."""
    out = dict(env)
    token = _token_from_env(env)
    if token:
        out["PDSERVE_CLUSTER_TOKEN"] = token
    return out


def validate_argv(role: str, settings: Mapping[str, Any]) -> list[str]:
    """`pdserve validate` arguments for the role's parallel config (prefill never uses DCP)."""
    argv = ["--model", str(settings["model"])]
    for key, flag in PARALLEL_KEYS.items():
        if key in settings and not (role != "decode" and key in DECODE_ONLY):
            argv += [flag, str(settings[key])]
    return argv


def check(role: str, settings: Mapping[str, Any]) -> int:
    """pdserve's parallel-config check (the `pdserve validate` code): 0 valid, 2 refused, 1 unreadable model."""
    if role in ("router", "openai"):
        return 0
    from pdserve.commands.validate import main_validate

    return main_validate(validate_argv(role, settings))


def write_health_state(role: str, settings: Mapping[str, Any], env: Mapping[str, str]) -> None:
    run_dir = Path(env.get("PDSERVE_RUN_DIR") or "/tmp/pdserve")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        state = {"role": role, "port": int(settings.get("port", DEFAULTS[role]["port"]))}
        (run_dir / "health.json").write_text(json.dumps(state), encoding="utf-8")
    except (OSError, ValueError) as e:  # the health check then falls back to PDSERVE_HEALTH_PORT / defaults
        warn(f"cannot write health state: {e}")


def prepare(role: str, env: Mapping[str, str]) -> dict[str, Any]:
    return resolve_model(resolve(role, load_file(env.get("PDSERVE_CONFIG")), env))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    if not argv:
        argv = ["router"]
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd in ROLES:
            settings = prepare(cmd, env)
            status = check(cmd, settings)
            if status != 0:
                return status
            settings = fit_to_service(cmd, settings, service_flags(cmd))
            write_health_state(cmd, settings, env)
            full = command(cmd, settings, rest)
            child_env = service_env(env)
            print("pdserve-entrypoint: exec " + " ".join(masked(full)), file=sys.stderr, flush=True)
            os.execve(full[0], full, child_env)
            return 127  # not reached
        if cmd in ("check", "print-args"):
            if not rest or rest[0] not in ROLES:
                raise EntrypointError(f"usage: pdserve-entrypoint {cmd} {{{','.join(ROLES)}}}")
            role = rest[0]
            settings = prepare(role, env)
            if cmd == "check":
                return check(role, settings)
            settings = fit_to_service(role, settings, service_flags(role))
            print(json.dumps(masked(command(role, settings, rest[1:]))))
            return 0
        if cmd == "healthcheck":
            here = Path(__file__).resolve().parent
            for cand in (here / "pdserve-healthcheck", here / "healthcheck.py"):
                if cand.is_file():
                    os.execv(sys.executable, [sys.executable, str(cand), *rest])
                    return 127  # not reached
            raise EntrypointError("pdserve-healthcheck not found next to the entrypoint")
    except EntrypointError as e:
        print(f"pdserve-entrypoint: error: {e}", file=sys.stderr)
        return 1
    os.execvp(cmd, [cmd, *rest])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
