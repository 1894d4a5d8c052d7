"""CPU priority of a local cluster's services: the routers and the HTTP front run at nice -10 by default where this
process may raise a priority (else 0, said in the notes), `router: {nice}` / `--router-nice` and a pod's `nice:` set
it, and each service gets it for its process and for its session's autogroup (with autogroups on, a process's own
nice weighs only inside its session). What the kernel reports for the started child is what is checked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pdserve.cluster import topology
from pdserve.cluster.supervisor import child_argv
from pdserve.cluster.topology import FRONT_NICE, Topology, TopologyError
from pdserve.parallel_config import ModelParallelInfo
from pdserve.sched import may_set_nice

GQA_1KV = ModelParallelInfo(num_attention_heads=8, num_kv_heads=1)

# What the exec'd child sees of itself: its nice and its session's autogroup line.
_REPORT = (
    "import json, os; from pathlib import Path; p = Path('/proc/self/autogroup'); "
    "print(json.dumps({'nice': os.getpriority(os.PRIO_PROCESS, 0), "
    "'autogroup': p.read_text().strip() if p.exists() else None}))"
)


def _child_reports(nice: int) -> dict:
    out = subprocess.run(
        child_argv([sys.executable, "-c", _REPORT], None, nice=nice),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # as the supervisor starts every service
    )
    assert out.returncode == 0, out.stderr
    assert "exec_child" not in out.stderr, out.stderr  # nothing was refused
    return json.loads(out.stdout)


def test_a_lower_priority_is_set_for_the_process_and_its_session():
    got = _child_reports(5)
    assert got["nice"] == 5
    if got["autogroup"] is not None:
        assert got["autogroup"].endswith(" nice 5")


@pytest.mark.skipif(not may_set_nice(-5), reason="raising a priority needs CAP_SYS_NICE")
def test_a_higher_priority_is_set_for_the_process_and_its_session():
    got = _child_reports(-5)
    assert got["nice"] == -5
    if got["autogroup"] is not None:
        assert got["autogroup"].endswith(" nice -5")


def _without_cap_sys_nice() -> list[str]:
    """A command prefix that runs without the privilege to raise priorities (setpriv drops it even for root)."""
    if not may_set_nice(-5):
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("this process may raise priorities and setpriv (util-linux) is missing to drop that")
    return ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice"]


def test_a_refused_priority_is_reported_and_the_service_still_starts():
    out = subprocess.run(
        [*_without_cap_sys_nice(), *child_argv([sys.executable, "-c", "print('started')"], None, nice=-5)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == "started"
    assert "exec_child: cannot set nice -5" in out.stderr


def test_pdserve_up_without_the_privilege_refuses_a_raised_priority_and_defaults_to_0(tmp_path):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 1}))
    (model / "tokenizer.json").write_text("{}")
    up = [*_without_cap_sys_nice(), sys.executable, "-m", "pdserve.cli", "up", "--dry-run", "--model", str(model)]
    out = subprocess.run([*up, "--router-nice", "-3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "router.nice -3 raises a CPU priority, which needs CAP_SYS_NICE" in out.stderr
    out = subprocess.run(up, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["router_nice"] == 0 and any("needs CAP_SYS_NICE" in n for n in plan["notes"])
    assert [p["nice"] for p in plan["pods"]] == [0, 0]


def test_routers_default_to_a_higher_priority_where_it_is_allowed(monkeypatch):
    monkeypatch.setattr(topology, "may_set_nice", lambda nice: True)
    t = Topology().resolve(GQA_1KV)
    assert t.router_nice == FRONT_NICE < 0 and all(p.nice == 0 for p in t.pods)
    assert t.placement()[0] == f"router and the HTTP front: nice {FRONT_NICE}"

    monkeypatch.setattr(topology, "may_set_nice", lambda nice: nice >= 0)
    t = Topology().resolve(GQA_1KV)
    assert t.router_nice == 0
    assert any("needs CAP_SYS_NICE" in n and "nice: 5" in n for n in t.notes)


def test_yaml_and_flags_set_priorities_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setattr(topology, "may_set_nice", lambda nice: True)
    t = Topology.from_dict({"router": {"nice": -3}, "prefill": [{"nice": 5}], "decode": {"count": 2, "nice": 7}})
    t.resolve(GQA_1KV)
    assert t.router_nice == -3 and [p.nice for p in t.pods] == [5, 7, 7]
    assert "decode-1: cpus" in t.placement()[-1] and t.placement()[-1].endswith(", nice 7")
    assert t.with_overrides(router_nice=2).router_nice == 2
    for bad, where in ((-21, "router.nice"), (20, "router.nice"), ("x", "router.nice")):
        with pytest.raises(TopologyError, match=where):
            Topology.from_dict({"router": {"nice": bad}})
    with pytest.raises(TopologyError, match=r"prefill\[0\].nice must be a nice value in \[-20, 19\]"):
        Topology.from_dict({"prefill": [{"nice": 40}]})

    # Asked for but not allowed: refused before anything starts, with what to do instead.
    monkeypatch.setattr(topology, "may_set_nice", lambda nice: nice >= 0)
    with pytest.raises(TopologyError, match="router.nice -3 raises a CPU priority, which needs CAP_SYS_NICE"):
        Topology.from_dict({"router": {"nice": -3}}).resolve(GQA_1KV)
    with pytest.raises(TopologyError, match="prefill-0: nice -1"):
        Topology.from_dict({"prefill": [{"nice": -1}]}).resolve(GQA_1KV)


def test_the_supervisor_hands_each_service_its_priority(monkeypatch, tmp_path):
    from pdserve.cluster.supervisor import LocalCluster

    monkeypatch.setattr(topology, "may_set_nice", lambda nice: True)
    t = Topology.from_dict({"router": {"count": 2}, "decode": [{"tp": 1, "dcp": 1, "nice": 4}]}).resolve(GQA_1KV)
    t.assign_ports()
    plan = {s.name: s.nice for s in LocalCluster(t, log_dir=tmp_path)._plan()}
    fronts = {"router": FRONT_NICE, "router-1": FRONT_NICE, "openai-http": FRONT_NICE}
    assert plan == {**fronts, "prefill-0": 0, "decode-0": 4}
    assert "--nice" not in child_argv(["x"], None) and child_argv(["x"], None, nice=4)[2:4] == ["--nice", "4"]
