#!/usr/bin/env bash
# The first checks on a machine with 1-8 GPUs, in at most 8 minutes, ending in one table:
# `pipewright profile --device cuda --calibration`, a bf16 profile, `train` at pp 2 (tp 2 as well with
# four GPUs or more) on every schedule for 3 steps, `check`, the MFU of a single-GPU step, and the
# simulator's step time against the measured one (tools/gpu_check.py plans the checks and reads
# their results).
#
# usage: tools/gpu_check.sh [--out DIR] [--gpus N] [--device cuda|cpu] [--budget SECONDS] [--dry-run]
#   --gpus N     GPUs to use (default: all that torch sees)
#   --device cpu the same checks on the CPU (gloo, fp32, a tiny model): exercises the script without a GPU
#   --budget S   total seconds (default 480): a check that cannot start in time is skipped
#   --dry-run    print the checks' commands and run none
set -euo pipefail

out="gpu-check-$(date -u +%Y%m%d-%H%M%S)"
gpus=""
device="cuda"
budget=480
dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --gpus) gpus="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"

if [[ -z "$gpus" ]]; then
    if [[ "$device" == "cuda" ]]; then
        gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
    else
        gpus=2
    fi
fi
if [[ "$device" == "cuda" && "$gpus" -lt 1 && "$dry_run" -eq 0 ]]; then
    echo "gpu_check.sh: no CUDA device visible; use --device cpu to exercise the checks on the CPU" >&2
    exit 2
fi
if [[ "$gpus" -gt 8 ]]; then
    gpus=8
fi
if [[ "$device" == "cuda" ]]; then
    CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((gpus - 1)))"
    export CUDA_VISIBLE_DEVICES
fi

plan="$("$python" tools/gpu_check.py plan --gpus "$gpus" --out "$out" --device "$device")"
if [[ "$dry_run" -eq 1 ]]; then
    echo "# $gpus $device device(s), budget ${budget} s, results in $out"
    while IFS=$'\t' read -r name timeout command; do
        echo "$name (≤ ${timeout} s): $command"
    done <<< "$plan"
    exit 0
fi

mkdir -p "$out/logs"
: > "$out/results.tsv"
start=$SECONDS
while IFS=$'\t' read -r name timeout command; do
    left=$((budget - (SECONDS - start)))
    log="$out/logs/${name//:/-}.log"
    if [[ "$left" -lt 20 ]]; then
        printf '%s\tskip\t0\n' "$name" >> "$out/results.tsv"
        echo "skipped (budget spent): $command" > "$log"
        continue
    fi
    limit=$((timeout < left ? timeout : left))
    echo "[$((SECONDS - start)) s] $name (≤ ${limit} s)" >&2
    began=$SECONDS
    rc=0
    # the planned command is one shell-quoted line (shlex.join): eval runs it as written
    eval "timeout --kill-after=10 $limit $command" > "$log" 2>&1 < /dev/null || rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" >> "$out/results.tsv"
done <<< "$plan"

echo
echo "pipewright GPU check: $gpus $device device(s), $((SECONDS - start)) s, logs in $out/logs"
"$python" tools/gpu_check.py table "$out"
