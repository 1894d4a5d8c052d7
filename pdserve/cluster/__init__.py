"""The embedded local cluster behind ``pdserve up``: a topology (flags or YAML, checked with pdserve.parallel_config)
and a supervisor that runs router, prefill and decode pods as local processes and never leaves one behind."""

from pdserve.cluster.supervisor import ClusterError, Endpoints, LocalCluster
from pdserve.cluster.topology import AUTO, PodSpec, Topology, TopologyError

__all__ = ["AUTO", "ClusterError", "Endpoints", "LocalCluster", "PodSpec", "Topology", "TopologyError"]
