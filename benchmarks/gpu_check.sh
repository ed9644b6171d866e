#!/bin/sh
# The GPU check: the CUDA tests and the GPU throughput figures, on a GPU machine, from the repo root,
# in under five minutes. Seeded random models only; the machine's own torch (PYTHONPATH=src, nothing
# installed). Without CUDA the tests skip and the figures are not printed.
#
#     sh benchmarks/gpu_check.sh            # record the output in docs/benchmarks.md ("GPU")
set -e
export PYTHONPATH=src HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# the repo's pytest settings name plugins this machine may lack: run with none of them
python -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=0 -m cuda tests/test_cuda.py
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || { echo "no CUDA: no GPU figures"; exit 0; }
python benchmarks/gpu_throughput.py --device cuda --dtype float16
python benchmarks/gpu_throughput.py --device cuda --dtype bfloat16 --llm-requests 0
