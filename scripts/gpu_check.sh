#!/usr/bin/env bash
# gpu_check.sh: run and check ddpkit's GPU path on a machine with one GPU (or more), in one go.
#
#   bash scripts/gpu_check.sh                # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --cpu          # the very same steps on CPU (gloo, --device cpu): a dry run
#   bash scripts/gpu_check.sh --steps 2,7    # only some steps (a step that needs the Wine reference runs it)
#
# The program is scripts/gpu_check.py (its docstring: the steps, the output, the time limits, the
# exit codes); this entry point only picks the interpreter that runs it, which is the one whose
# torch is checked: $PYTHON if set, else (with --cpu) this checkout's .venv/bin/python when it
# exists, else python3.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 2
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  for arg in "$@"; do [[ $arg == --cpu && -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python; done
fi
exec "$PYTHON" "$REPO/scripts/gpu_check.py" "$@"
