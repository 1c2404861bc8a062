#!/usr/bin/env bash
# Every GPU check of the project in one run, most important first, each under its own limit.
#
#   bash benchmarks/gpu_session.sh [OUTDIR]        # default OUTDIR: $OUT, else ./gpu_session_out
#
# One log per check goes to OUTDIR (gpu_check.txt, smoke.txt, ...); the console gets one line per
# check (exit status, seconds) and the tail of each log. Checks that need more GPUs than the
# machine has are listed as skipped with the reason. Limits (seconds) can be overridden through
# the environment: GPU_CHECK_S, SMOKE_S, ATTENTION_S, MOE_S, CP_S, TRAIN_S, FUSED_S, ZB_S.
#
# Runs from a source checkout: when `import tpfuse` fails it tries an editable install without
# build isolation, and failing that (no network, no build tools) maps the repository's folders
# onto the tpfuse namespace in a throw-away PYTHONPATH, as setup.py's package_dir does.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$repo/gpu_session_out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tpfuse_triton_cache}
work=$(mktemp -d)          # commands run here: the checkout's tpfuse/ folder must not shadow
cd "$work"

if ! python3 -c "import tpfuse.kernels" 2>/dev/null; then
    pip install -q --no-deps --no-build-isolation -e "$repo" >/dev/null 2>&1 || true
fi
if ! python3 -c "import tpfuse.kernels" 2>/dev/null; then
    mkdir -p "$work/path/tpfuse"
    for file in "$repo"/tpfuse/*; do ln -sf "$file" "$work/path/tpfuse/"; done
    for folder in "$repo"/*/; do
        name=$(basename "$folder")
        [ -f "$folder/__init__.py" ] && [ "$name" != tpfuse ] && [ "$name" != tests ] \
            && ln -sfn "$repo/$name" "$work/path/tpfuse/$name"
    done
    export PYTHONPATH="$work/path${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'triton', triton.__version__)"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus; logs in $out"

check() {   # check NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
    tail -n "${TAIL_LINES:-25}" "$out/$name.txt"
}

bench=$repo/benchmarks
check gpu_check "${GPU_CHECK_S:-300}" python3 "$bench/gpu_check.py"
check smoke "${SMOKE_S:-260}" python3 "$bench/gpu_smoke.py"
check attention "${ATTENTION_S:-150}" python3 "$bench/gpu_attention_check.py"
check moe "${MOE_S:-150}" python3 "$bench/gpu_moe_check.py"
check context_parallel "${CP_S:-150}" python3 "$bench/gpu_context_parallel_check.py"
check train_bf16_distopt "${TRAIN_S:-200}" python3 -m tpfuse.training.launcher \
    --preset stdlib-demo --nproc-per-node "$gpus" --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    --overlap-param-gather --train-iters 20 --log-interval 5 --eval-interval 1000 --eval-iters 1 \
    --timing-log-level 2 --save "$out/ckpt"
if [ "$gpus" -ge 2 ]; then
    check fused_comm "${FUSED_S:-300}" torchrun --nproc-per-node "$gpus" \
        "$bench/gpu_fused_comm_check.py"
else
    echo "== fused_comm: skipped (needs >= 2 GPUs for the overlap; one GPU times GEMMs only)"
fi
if [ "$gpus" -ge 4 ]; then
    for schedule in 1f1b zb-h1; do
        check "pipeline_$schedule" "${ZB_S:-200}" python3 -m tpfuse.training.launcher \
            --preset stdlib-demo --nproc-per-node 4 --tensor-model-parallel-size 1 \
            --pipeline-model-parallel-size 4 --num-layers 16 --hidden-size 1024 \
            --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 \
            --micro-batch-size 2 --global-batch-size 32 --bf16 --pipeline-schedule "$schedule" \
            --train-iters 20 --log-interval 5 --eval-interval 1000 --eval-iters 1 \
            --timing-log-level 2 --timing-log-option all
    done
else
    echo "== pipeline_1f1b / pipeline_zb-h1: skipped (the bubble comparison needs >= 4 GPUs)"
fi
rm -rf "$work"
