#!/usr/bin/env bash
# One prepared GPU session (about 9 minutes on one H200): the main job on the card, the GPU check, and the guard and
# compiled parts of gpu_paths.py with whatever time is left. Files go to $OUT (default /tmp/gpu_out); each step
# prints its elapsed time. Run from the repository root:  bash benchmarks/gpu_session.sh
# Wheels for a machine without Optuna (and its kin) may lie in .gpu/wheels (ignored by git); they are installed to
# $HOME/gpu-site without an index.
if compgen -G ".gpu/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$HOME/gpu-site" .gpu/wheels/*.whl
  export PYTHONPATH="$HOME/gpu-site:$PWD"
fi
export LIGHTNING_CKPT_ALLOW_UNTESTED_TORCH=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/gpu_out}; mkdir -p "$O"; S=$SECONDS
t(){ echo "== $1 rc=$2 at $((SECONDS-S)) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, lightning, optuna; print(torch.__version__, lightning.__version__, optuna.__version__)"
timeout 150 python examples/train_gpt.py --plan "$O/gpt_plan.json" --logs /tmp/runs >"$O/main_job.log" 2>&1; t main_job $?
R=$((520-(SECONDS-S))); G=$((R-150)); [ "$G" -gt 330 ] && G=330
timeout $((G+25)) python benchmarks/gpu_check.py --time-budget "$G" --hard-limit $((G+20)) --out "$O/gpu_check.json" \
  >"$O/gpu_check.log" 2>&1; t gpu_check $?
R=$((530-(SECONDS-S)))
if [ "$R" -gt 30 ]; then
  timeout "$R" python benchmarks/gpu_paths.py --parts guard,compiled --out "$O/gpu_paths.json" >"$O/gpu_paths.log" 2>&1
  t gpu_paths $?
else
  echo "== gpu_paths skipped: $R s left"
fi
tr '\r' '\n' <"$O/main_job.log" | grep -E "GPU available|lightning_ckpt|final|Error" | cut -c1-300 | tail -20
grep -A14 "=== gpu_check" "$O/gpu_check.log" || tail -30 "$O/gpu_check.log"
tail -15 "$O/gpu_paths.log"
