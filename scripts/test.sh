#!/usr/bin/env bash
# The test suite, as `make test` runs it: first every test that is safe to run beside another,
# in parallel (pytest-xdist, one file per worker at a time), then alone the tests that must
# not share the machine: multi-node and SLURM tests (`cluster`: network namespaces, one SLURM
# cluster) and `serial` ones (short timeouts, a slow rank to be named). The reference runs the
# tests compare with are trained once for both phases (tests/conftest.py, DDPKIT_TEST_SHARED).
# Arguments go to pytest; a `-m EXPR` of your own narrows both phases.
# DDPKIT_TEST_WORKERS: parallel workers (default: half the cores, at least 2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mine="" args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "-m" ] && [ $# -ge 2 ]; then mine="($2) and "; shift 2; else args+=("$1"); shift; fi
done
set -- ${args[@]+"${args[@]}"}
cores=$(nproc 2>/dev/null || echo 2)
workers=${DDPKIT_TEST_WORKERS:-$(( cores / 2 > 2 ? cores / 2 : 2 ))}
DDPKIT_TEST_SHARED=$(mktemp -d "${TMPDIR:-/tmp}/ddpkit-tests-XXXXXX")
export DDPKIT_TEST_SHARED
trap 'rm -rf "$DDPKIT_TEST_SHARED"' EXIT

"$PY" -m pytest -q -n "$workers" --dist loadfile -m "${mine}not serial and not cluster" "$@"
parallel=$?
"$PY" -m pytest -q -m "${mine}(serial or cluster)" "$@"
alone=$?
# 5 is pytest's "no test selected": fine for one phase (e.g. `make test PYTEST_ARGS=tests/unit`)
if [ $parallel -eq 5 ] && [ $alone -eq 5 ]; then exit 5; fi
for rc in $parallel $alone; do
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit 1; fi
done
exit 0
