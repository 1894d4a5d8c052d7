"""Read a pod's vLLM-named metrics the way Prometheus parses them (prometheus_client's text parser)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_vllm(port: int, model_name: str) -> tuple[dict[str, float], dict[str, str]]:
    """({sample name + labels other than model_name/engine: value}, {family name: type}) of the vllm: families.

    Every sample must carry vLLM's labels: model_name (the served model) and engine "0"."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(body):
        if not fam.name.startswith("vllm:"):
            continue
        types[fam.name] = fam.type
        for s in fam.samples:
            labels = dict(s.labels)
            assert (labels.pop("model_name", None), labels.pop("engine", None)) == (model_name, "0"), s
            extra = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return samples, types


def bucket_bounds(samples: dict[str, float], histogram: str) -> list[float]:
    prefix = f'{histogram}_bucket{{le="'
    return sorted(float(k[len(prefix) : -2]) for k in samples if k.startswith(prefix))
