#!/usr/bin/env bash
# ZeRO-Infinity's point, shown with a cgroup memory limit (root, cgroup v1 memory controller): a 164M-parameter llama
# (the tiny recipe widened to 12 x 1024) on 2 CPU ranks for 3 steps, under zero3.json and under an fp32 copy of
# zero3_offload_nvme_bf16.json whose swap folder is OUT/swap, both inside the same memory limit (BENCHMARKS.md has
# what it measured). Prints each run's exit status, the cgroup's peak and the last logged step.
#   bench/nvme_cgroup.sh [LIMIT=20G] [OUT=/tmp/dstrain-nvme-cgroup]      (needs data/pydocs: scripts/demo makes it)
set -u
limit=${1:-20G} out=${2:-/tmp/dstrain-nvme-cgroup}
cd "$(dirname "$0")/.." && mkdir -p "$out"
export PYTHONPATH=$PWD/src PATH=$PWD/.venv/bin:$PATH HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
c = json.load(open("ds_configs/zero3_offload_nvme_bf16.json"))
for key in ("bf16", "data_types", "communication_data_type", "activation_checkpointing"):
    c.pop(key)
z = c["zero_optimization"]
z["sub_group_size"] = 2**22  # pinned optimizer buffers: 4 x 2^22 fp32 = 64 MiB per rank
z["offload_optimizer"].update(nvme_path=f"{out}/swap", buffer_count=4)
z["offload_param"].update(nvme_path=f"{out}/swap", buffer_count=4, buffer_size=2**21)  # the embedding's partition
for name, config in (("zero3_nvme", c), ("zero3", json.load(open("ds_configs/zero3.json")))):
    config["train_micro_batch_size_per_gpu"] = 2
    # smaller buckets than the shipped 5e7 elements: what both keep in memory is then mostly the model states
    config["zero_optimization"].update(reduce_bucket_size=10**7, stage3_prefetch_bucket_size=10**7)
    json.dump(config, open(f"{out}/{name}.json", "w"), indent=1)
PY
for name in zero3 zero3_nvme; do
  rm -rf "$out/run_$name" "$out/swap"
  cg=/sys/fs/cgroup/memory/dstrain_nvme_$name
  (mkdir -p $cg && echo "$limit" > $cg/memory.limit_in_bytes && echo $BASHPID > $cg/tasks && \
   exec torchrun --nproc_per_node 2 --master_port $((29500 + RANDOM % 1000)) -m dstrain.train \
     --recipe recipes/tiny.yaml --deepspeed_config "$out/$name.json" run_dir="$out/run_$name" model.n_layer=12 \
     model.d_model=1024 model.n_head=16 model.n_kv_head=16 data.seq_len=64 train.global_batch=4 train.steps=3 \
     train.log_interval=1 train.eval_samples=4 schedule.warmup_steps=1) > "$out/$name.log" 2>&1
  code=$?
  last=$(grep -h '"loss"' "$out/run_$name/metrics.jsonl" 2>/dev/null | grep -v split | tail -1)
  echo "$name: exit $code; peak $(( $(cat $cg/memory.max_usage_in_bytes) / 1048576 )) MiB of $limit;" \
       "last step: ${last:-none} (log: $out/$name.log)"
  rmdir $cg 2>/dev/null
done
