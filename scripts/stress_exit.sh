#!/usr/bin/env bash
# Run the default job (`ddpkit train`: Wine, 2 processes, 100 epochs) N times in a row and
# count clean exits. torch 2.13 aborts ~9% of DDP runs at interpreter exit unless the objects
# holding the process group are released first; ddpkit must exit cleanly every time.
# Usage: scripts/stress_exit.sh [N=30] [extra ddpkit train flags...]
set -u
n=${1:-30}; shift || true
ddpkit=${DDPKIT:-ddpkit}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ok=0; fail=0
for i in $(seq 1 "$n"); do
  if "$ddpkit" train --quiet --run-dir "$work/run$i" "$@" >"$work/log$i" 2>&1; then
    ok=$((ok + 1))
  else
    rc=$?; fail=$((fail + 1))
    echo "run $i: exit code $rc"; cat "$work/log$i"
  fi
  rm -rf "$work/run$i"
done
echo "clean exits: $ok of $n (failed: $fail)"
[ "$fail" -eq 0 ]
