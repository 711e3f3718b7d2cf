# Sourced by setup_cluster.sh and stop_cluster.sh: the test cluster's network, and what it owns.
# shellcheck shell=bash disable=SC2034
NET_PREFIX=10.213.0                  # a private /24 that only these namespaces use (checked at setup)
BRIDGE=sltest-br0                    # on the host, holding $NET_PREFIX.254 (slurmctld listens there)
BRIDGE_ADDR=$NET_PREFIX.254
declare -A NODE_ADDR=([node1]=$NET_PREFIX.1 [node2]=$NET_PREFIX.2)
netns_of() { echo "slurmtest-$1"; }  # the node's network namespace
veth_of() { echo "sltest-$1"; }      # the host's end of the node's veth pair (the node's end is eth0)
# What setup_cluster.sh created, one name a line ("netns NAME", "link NAME"): stop_cluster.sh
# removes only these, and setup refuses to reuse a namespace or link of the same name missing here.
OWNED=/run/slurm-test-cluster/owned
HOSTS_TAG="# tests/slurm/setup_cluster.sh"  # ends each line it adds to /etc/hosts
