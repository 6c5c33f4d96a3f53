#!/usr/bin/env bash
# One device check on a lent NVIDIA GPU, in one go (device time is scarce): the quick probe (clock droop, GEMMs
# under sustained load, whole torch decoder steps) and the calibrated mode (the plan measured, fitted, then
# checked on grid shapes outside the plan). Writes under OUT (default results/probe/<date>;
# a dry run results/probe/dry-run/<date>):
#   probe/probe.json probe/probe.png cal/calibration.json cal/summary.json cal/*.csv cal/holdout/*.csv log.txt
# Usage: bench/gpu_check.sh [--dry-run] [OUT]     (--dry-run: the same pipeline on the CPU)
# PARTS="probe cal" (default; in that order), HOLDOUT_S=140 (seconds of held-out shapes after the plan).
# The probe is stopped after 240 s, the calibration (110 s of plan at most, then the holdout) after 270 s
# (SIGTERM: both write what they measured), so the two fit one 600 s device call.
# Needs python3 with torch (CUDA) and nvidia-ml-py; runs from the repository root with PYTHONPATH=. .
set -u
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; shift; fi
# a dry run's tables never share a folder with a GPU run's (results/probe/dry-run/ is ignored by git)
OUT=${1:-results/probe/${DRY:+dry-run/}$(date -u +%Y%m%d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
  [ -z "$DRY" ] && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv
  for part in ${PARTS:-probe cal}; do
    case $part in
      probe) echo "== probe --quick"
             timeout 240 $PY -m m2live probe --quick $DRY --time-limit 200 --out "$OUT/probe"; echo "rc=$?" ;;
      cal)   echo "== probe --calibrate --holdout"
             timeout 270 $PY -m m2live probe --calibrate $DRY --holdout ${HOLDOUT_S:-140} --out "$OUT/cal"; echo "rc=$?" ;;
      *)     echo "unknown part $part (probe, cal)"; exit 2 ;;
    esac
  done
  date -u +%FT%TZ
} 2>&1 | tee "$OUT/log.txt"
