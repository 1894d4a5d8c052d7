"""CPU placement of pods: `cpus:` in topology files and `pdserve up --prefill-cpus/--decode-cpus`. The cores asked
for are what the kernel reports for the pod and for every TP rank it spawns (os.sched_getaffinity of each pid), each
rank gets cores / TP threads, and `pdserve up` logs the placement before it starts anything. The same run checks the
CPU priorities the kernel reports: the router's (process and session) and the pods' (tests/cluster/test_cpu_priority.py
has the rest)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from up_helpers import UpProcess

from pdserve.cluster.topology import FRONT_NICE, Topology, TopologyError, format_cpus, parse_cpus
from pdserve.sched import may_set_nice

pytestmark = pytest.mark.slow  # pdserve up with pinned pods


def test_core_lists_parse_and_print_like_cpuset():
    assert parse_cpus("0-2,5") == (0, 1, 2, 5)
    assert parse_cpus([3, 1, 1]) == (1, 3)
    assert parse_cpus(2) == (2,)
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    for bad in ("a-b", [], [-1], "1,,x", True, [0.5]):
        with pytest.raises(TopologyError, match="cpus"):
            parse_cpus(bad)


def test_topology_file_and_flags_set_cpus(tiny_factory):
    model = tiny_factory("llama", num_kv_heads=1)
    topo = Topology.from_dict({"model": str(model), "prefill": [{"cpus": [0]}], "decode": [{"tp": 1, "cpus": "0"}]})
    assert topo.prefill[0].cpus == (0,) and topo.decode[0].cpus == (0,)
    t2 = topo.with_overrides(decode_cpus="0").resolve()
    assert t2.decode[0].cpus == (0,)
    assert any(line.startswith("decode-0: cpus 0,") for line in t2.placement())
    with pytest.raises(TopologyError, match="cores this machine does not offer"):
        topo.with_overrides(prefill_cpus="4096").resolve()
    with pytest.raises(TopologyError, match="prefill\\[0\\].cpus"):
        Topology.from_dict({"prefill": [{"cpus": "x"}]})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to give each pod its own")
def test_pdserve_up_pins_pods_and_their_ranks_and_sets_priorities(tmp_path, tiny_factory):
    model = tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    up = UpProcess(
        [
            "--model",
            str(model),
            "--port",
            "0",
            "--http-port",
            "-1",
            "--num-kv-blocks",
            "64",
            "--decode-tp",
            "2",
            "--decode-dcp",
            "2",
            "--prefill-cpus",
            str(first),
            "--decode-cpus",
            str(second),
        ],
        log_dir=tmp_path / "logs",
        env=env,
        startup_timeout=300,
    )
    with up:
        pods = {s["name"]: s["pid"] for s in up.info["services"]}
        prefill, decode = psutil.Process(pods["prefill-0"]), psutil.Process(pods["decode-0"])
        assert os.sched_getaffinity(prefill.pid) == {first}
        ranks = decode.children(recursive=True)
        assert ranks, "the TP 2 decode pod has a second rank process"
        for p in [decode, *ranks]:
            assert os.sched_getaffinity(p.pid) == {second}, p.cmdline()
        # threads per rank = cores given / TP: one core for two ranks is one thread each
        assert decode.environ()["OMP_NUM_THREADS"] == "1" and prefill.environ()["OMP_NUM_THREADS"] == "1"
        out = up.output.read_text()
        assert f"placement prefill-0: cpus {first}, 1 thread(s) per rank x 1 rank(s), nice 0" in out
        assert f"placement decode-0: cpus {second}, 1 thread(s) per rank x 2 rank(s), nice 0" in out
        # the router above the pods: for its process and its session's autogroup; the ranks inherit their pod's
        front = FRONT_NICE if may_set_nice(FRONT_NICE) else 0
        assert f"placement router: nice {front}" in out
        for pid, nice in [(pods["router"], front), (prefill.pid, 0), *((p.pid, 0) for p in [decode, *ranks])]:
            assert os.getpriority(os.PRIO_PROCESS, pid) == nice
            group = Path(f"/proc/{pid}/autogroup")
            if group.exists():
                assert group.read_text().strip().endswith(f" nice {nice}"), (pid, group.read_text())
    assert up.wait_all_gone(10) == []
