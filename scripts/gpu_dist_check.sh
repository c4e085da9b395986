#!/usr/bin/env bash
# Distributed GPU check, on a machine with 2+ GPUs: an FSDP2 model and its AdamW state
# saved at 2 ranks (NCCL) through Engine.save, dcp.save and dcp.async_save (tiered.dcp.GpuStager),
# loaded at 2 and at 1 rank, compared bit for bit with the full state gathered at save time; Engine.save after
# Engine.reserve (which plans with DCP), then five more Engine.save calls (the cached plan) print how long each
# blocked training; then guarded saves whose planning runs on each rank's stager thread, bit-exact.
# Usage (from the repository root):  bash scripts/gpu_dist_check.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-./gpu-dist-check}}
mkdir -p "$out"
work=$(mktemp -d)
cat > "$work/fsdp.yaml" <<YAML
version: 1
tiers:
  - name: local
    kind: local
    path: $work/nvme
    codec: ans
YAML
run() {  # nproc, then the worker's arguments
  local n=$1; shift
  echo "== torchrun $n ranks: $*"
  python3 -m torch.distributed.run --nproc_per_node="$n" --master_addr=127.0.0.1 --master_port=$((29500 + RANDOM % 1000)) \
    tests/dist_worker.py "$@" --config "$work/fsdp.yaml" --fsdp "$work/ref-$step.pt" --width 2048 --layers 8
}
status=0
for how in engine dcp async; do
  step=$(case $how in engine) echo 1;; dcp) echo 20;; async) echo 30;; esac)
  if [ $how = engine ]; then
    # reserve() first (DCP plans there; each rank's layout and kernels readied), then the warm saves' stall
    run 2 save --step $step --how $how --repeats 5 --reserve || status=1
  else
    run 2 save --step $step --how $how || status=1
  fi
  load_how=$([ $how = async ] && echo dcp || echo $how)
  run 2 load --step $step --how $load_how || status=1
  run 1 load --step $step --how $load_how || status=1
done
# Guarded saves: with defer_walk=True, from the second on, each rank's stager thread plans with DCP over
# the engine's gloo group while training's NCCL default group is left alone; the default guard plans in the call
for mode in "" --auto; do
  echo "== torchrun 2 ranks: save-guarded $mode --cuda (NCCL)"
  python3 -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=$((29500 + RANDOM % 1000)) \
    tests/dist_worker.py save-guarded --step $([ -z "$mode" ] && echo 40 || echo 50) $mode --cuda --backend nccl \
    --config "$work/fsdp.yaml" || status=1
done
python3 - "$work/nvme" <<'PY' || status=1
import json, pathlib, sys
for d in sorted(pathlib.Path(sys.argv[1]).glob("step_*")):
    m = json.loads((d / "MANIFEST.json").read_text())
    idx = [json.loads((d / r["index_file"]).read_text()) for r in m["ranks"]]
    print(d.name, "world_size", m["world_size"], "ranks", [r["rank"] for r in m["ranks"]],
          "raw", m["raw_bytes"], "stored", m["stored_bytes"], f"saved {100 * (1 - m['stored_bytes'] / m['raw_bytes']):.1f}%",
          "codecs", sorted({t["codec"]["name"] for i in idx for t in i["tensors"]}), "io", sorted({i["io"] for i in idx}))
PY
echo "distributed GPU check exit $status"
exit $status
