"""bench/common.py start_side, the cluster side bench serve and bench interference start: a prefill pod and a decode
pod on a core each (or one unified pod), behind an OpenAI front; with the router's --local-prefill-max-tokens auto,
local_prefill_thresholds reads the threshold the router derived for the decode pod. Real processes on loopback."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from bench.common import local_prefill_thresholds, start_side

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["disaggregated", "unified"])
def test_a_side_serves_completions_and_reports_its_thresholds(kind, tiny_factory, tmp_path):
    model = tiny_factory("llama")
    cores = (sorted(os.sched_getaffinity(0)) * 2)[:2]  # a one-core machine pins both pods to it
    auto = ["--local-prefill-max-tokens", "auto"] if kind == "disaggregated" else []
    cluster, url, served = start_side(
        kind, str(model), cores, tmp_path, num_kv_blocks=64, max_num_seqs=4, max_model_len=256, router_args=auto
    )
    try:
        body = json.dumps({"model": served, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert out["usage"]["completion_tokens"] == 3
        thresholds = local_prefill_thresholds(cluster)
        if kind == "disaggregated":  # a decode pod with a profile gets at least one token under auto
            assert list(thresholds) == ["decode-0"] and thresholds["decode-0"] >= 1
        else:
            assert thresholds == {}
    finally:
        cluster.stop()
