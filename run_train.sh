#!/usr/bin/env bash
# Train with torchrun. NGPU ranks (default: every GPU, or 2 CPU processes without one),
# CONFIG_FILE recipe (default: the embedded debug model); extra arguments are config
# overrides passed to train.py, e.g.  NGPU=1 bash run_train.sh --training.steps 20
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
if [ -z "${NGPU:-}" ]; then
  NGPU=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
CONFIG_FILE="${CONFIG_FILE:-./train_configs/debug_model.toml}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/torchrun --standalone --nproc_per_node="$NGPU" --local-ranks-filter 0 --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"
