#!/usr/bin/env bash
# The scaling matrix of issue 11 (tools/bench/scaling_cli.py --matrix): OFT LoRA, PI0 LoRA and PI0
# full fine-tune on 1 GPU, 2 GPUs ZeRO-2 and 2 GPUs ZeRO-3 at a global batch of 32, then a table.
#   tools/bench/scaling_all.sh [--cases pi0_full] [--configs 1gpu,2gpu_ddp,2gpu_z2,2gpu_z3] [--out-dir DIR] ...
# Every launch runs with NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m tools.bench.scaling_cli --matrix "$@"
