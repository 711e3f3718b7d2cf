#!/usr/bin/env bash
# Stop the local test Slurm cluster started by tests/slurm/setup_cluster.sh.
# munged is left running (harmless, and reused by the next setup).
set -euo pipefail

for name in slurmctld slurmd; do
    pkill -x "$name" 2>/dev/null || true
done

for i in $(seq 1 50); do
    if ! pgrep -x slurmctld >/dev/null 2>&1 && ! pgrep -x slurmd >/dev/null 2>&1; then
        echo "stop_cluster.sh: Slurm daemons stopped"
        exit 0
    fi
    if [[ $i -eq 30 ]]; then
        pkill -9 -x slurmctld 2>/dev/null || true
        pkill -9 -x slurmd 2>/dev/null || true
    fi
    sleep 0.2
done

echo "stop_cluster.sh: some Slurm daemons are still running" >&2
exit 1
