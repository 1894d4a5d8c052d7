"""The chart refuses invalid parallel configs with exactly the messages of pdserve.parallel_config.

1. A grid of (model shape, TP, DCP, PP, interleave, block size) configurations is rendered in one `helm template`
   call through a harness chart that includes the real chart's templates/_parallel.tpl, and every message (or "",
   valid) is compared with pdserve.parallel_config.check_parallel_config for the same numbers. Every rule is hit.
2. Impossible model shapes give ModelParallelInfo's own messages.
3. Broken values files, rendered with the real chart, fail with "<role>: invalid parallel config: <message>", the
   same text `pdserve validate` prints for the numbers the chart names.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_helpers import FIXTURES, REPO, checks

from pdserve.parallel_config import RULES, ModelParallelInfo, ParallelConfig, check_parallel_config

CHART = REPO / "deploy" / "helm" / "pdserve"

HARNESS_TEMPLATE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: parallel-cases
data:
{{- range $i, $c := .Values.cases }}
  {{ printf "c%05d" $i }}: {{ include "%(helper)s" $c | quote }}
{{- end }}
"""


def _render_cases(tools, tmp_path: Path, helper: str, cases: list[dict]) -> list[str]:
    chart = tmp_path / "harness"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: harness\nversion: 0.0.0\n")
    shutil.copy(CHART / "templates" / "_parallel.tpl", chart / "templates" / "_parallel.tpl")
    (chart / "templates" / "cases.yaml").write_text(HARNESS_TEMPLATE.replace("%(helper)s", helper))
    values = tmp_path / "cases.json"
    values.write_text(json.dumps({"cases": cases}))
    r = checks.helm_template(tools, [values], chart=chart, release="harness")
    assert r.ok, r.output[-3000:]
    data = yaml.safe_load(r.output)["data"]
    return [data[f"c{i:05d}"] for i in range(len(cases))]


def _python_message(c: dict) -> tuple[str, str | None]:
    model = ModelParallelInfo(
        num_attention_heads=c["heads"], num_kv_heads=c["kv"], use_mla=c["mla"], sliding_window=c["sw"] or None
    )
    cfg = ParallelConfig(
        tensor_parallel_size=c["tp"],
        decode_context_parallel_size=c["dcp"],
        pipeline_parallel_size=c["pp"],
        dcp_kv_cache_interleave_size=c["inter"],
        block_size=c["block"],
    )
    v = check_parallel_config(model, cfg)
    return ("" if v.valid else v.message), v.rule


def _grid() -> list[dict]:
    shapes = [
        (h, kv, mla)
        for h in (1, 4, 8, 9, 12, 16, 32, 64)
        for kv in (1, 2, 3, 4, 8, 16, 32, 64)
        for mla in (False, True)
        if kv <= h and (mla or h % kv == 0)
    ]
    sizes = dict(
        tp=(-1, 0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
        dcp=(0, 1, 2, 3, 4, 8),
        pp=(1, 1, 1, 0, 2),
        inter=(1, 1, 2, 4, 16, 32, 0),
        block=(16, 16, 8, 32, 0),
        sw=(0, 0, 0, 4096),
    )
    everything = list(itertools.product(shapes, *sizes.values()))
    rng = random.Random(8)
    picked = rng.sample(everything, 2500)
    # Hand-picked: one per rule at least, whatever the sample drew.
    picked += [
        ((9, 3, False), 2, 2, 1, 1, 16, 0),  # heads % tp
        ((9, 3, False), 4, 3, 1, 1, 16, 0),  # tp % dcp
        ((16, 2, False), 2, 2, 1, 1, 16, 0),  # tp <= kv
        ((16, 2, False), 4, 4, 1, 1, 16, 0),  # dcp > tp // kv
        ((12, 4, False), 12, 2, 1, 1, 16, 0),  # q per kv % dcp
        ((8, 1, False), 2, 2, 1, 32, 16, 0),  # interleave vs block
        ((12, 4, False), 6, 1, 1, 1, 16, 0),  # kv split
        ((24, 2, False), 12, 4, 1, 1, 16, 0),  # DCP group shares a KV head
        ((8, 1, False), 2, 2, 1, 1, 16, 4096),  # sliding window
        ((8, 1, True), 2, 2, 1, 1, 16, 0),  # MLA, valid
        ((8, 1, False), 0, 1, 1, 1, 16, 0),  # positive sizes
        ((8, 1, False), 2, 2, 1, 1, 16, 0),  # valid
    ]
    return [
        dict(heads=s[0], kv=s[1], mla=s[2], tp=tp, dcp=dcp, pp=pp, inter=inter, block=block, sw=sw)
        for s, tp, dcp, pp, inter, block, sw in picked
    ]


def test_parallel_rules_match_pdserve_parallel_config(tools, tmp_path):
    cases = _grid()
    chart_messages = _render_cases(tools, tmp_path, "pdserve.parallelError", cases)
    rules_hit = set()
    mismatches = []
    for c, got in zip(cases, chart_messages):
        want, rule = _python_message(c)
        rules_hit.add(rule)
        if got != want:
            mismatches.append(f"{c}: chart {got!r} != pdserve {want!r}")
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ:\n" + "\n".join(mismatches[:20])
    assert {r for r, _ in RULES} | {None} == rules_hit, f"rules never hit: {set(r for r, _ in RULES) - rules_hit}"


def test_model_shape_messages_match_model_parallel_info(tools, tmp_path):
    cases = [
        dict(heads=h, kv=kv, mla=mla, sw=sw)
        for h in (-1, 0, 8, 9)
        for kv in (-2, 0, 1, 2, 3)
        for mla in (False, True)
        for sw in (-1, 0, 4096)
    ]
    chart_messages = _render_cases(tools, tmp_path, "pdserve.modelError", cases)
    for c, got in zip(cases, chart_messages):
        try:
            ModelParallelInfo(
                num_attention_heads=c["heads"],
                num_kv_heads=c["kv"],
                use_mla=c["mla"],
                sliding_window=None if c["sw"] == 0 else c["sw"],
            )
            want = ""
        except ValueError as e:
            want = str(e)
        assert got == want, c


BROKEN_VALUES = [
    "values-broken-dcp.yaml",
    "values-broken-dcp-gqa.yaml",
    "values-broken-interleave.yaml",
    "values-broken-prefill.yaml",
]


def _numbers(values_file: Path) -> tuple[str, dict]:
    """The role the file breaks and the numbers the chart checks for it (chart defaults filled in)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    v = yaml.safe_load(values_file.read_text())
    model = {**defaults["model"], **v.get("model", {})}
    role = "prefill" if "prefill" in v else "decode"
    r = {**defaults[role], **v.get(role, {})}
    nums = dict(
        heads=model["numAttentionHeads"],
        kv=model["numKvHeads"],
        mla=model["useMla"],
        sw=model["slidingWindow"],
        tp=r["tensorParallelSize"],
        pp=1,
        block=r["blockSize"],
        dcp=r.get("decodeContextParallelSize", 1) if role == "decode" else 1,
        inter=r.get("dcpKvCacheInterleaveSize", 1) if role == "decode" else 1,
    )
    return role, nums


@pytest.mark.parametrize("name", BROKEN_VALUES)
def test_broken_values_fail_with_pdserve_validate_message(render, name):
    values = FIXTURES / name
    role, nums = _numbers(values)
    want, _ = _python_message(nums)
    assert want, f"{name} is not broken for pdserve.parallel_config"
    out = render([values])
    assert not out.ok, f"{name} rendered"
    assert f"{role}: invalid parallel config: {want}" in out.output, out.output
    # The chart names the `pdserve validate` command for the same numbers; it refuses with the same message.
    m = re.search(r"pdserve validate (--num-attention-heads [^\n]*)", out.output)
    assert m, out.output
    args = m.group(1).strip().rstrip('"').split()
    cli = subprocess.run([sys.executable, "-m", "pdserve.commands.validate", *args], capture_output=True, text=True)
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.splitlines()[0] == f"invalid parallel config: {want}"


def test_valid_dcp_values_render(render):
    # The compose layout on the tiny MQA model, and the examples' numbers, pass.
    out = render(
        sets=[
            "model.numAttentionHeads=8",
            "model.numKvHeads=1",
            "decode.tensorParallelSize=2",
            "decode.decodeContextParallelSize=2",
        ]
    )
    assert out.ok, out.output
