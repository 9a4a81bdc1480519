#!/usr/bin/env bash
# The digits MLP (examples/digits.json) trained over MPI ranks on this machine, two by default:
# every rank takes its part of each global batch of 64, rank 0 writes the checkpoints and metrics
# (runs/digits). Needs the mpi extra (pip install -e '.[mpi]': mpi4py and MPICH's mpiexec).
# Across hosts: the same command with your cluster's mpiexec (-hosts a,b) or srun.
#   examples/digits_mpi.sh            # 2 ranks
#   RANKS=3 examples/digits_mpi.sh --resume runs/digits
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
mpiexec=$(dirname "$python")/mpiexec
[ -x "$mpiexec" ] || mpiexec=mpiexec
exec "$mpiexec" -n "${RANKS:-2}" "$python" -m flow run examples/digits.json "$@"
