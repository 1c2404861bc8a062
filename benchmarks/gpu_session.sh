#!/usr/bin/env bash
# The project's GPU session: every GPU check in priority order, each under its own limit, in one
# command that fits a 10-minute run on one H200 (the limits add up to 540 s).
#
#   bash benchmarks/gpu_session.sh [--dry-run] [--keep-logs] [--only NAME,NAME] OUTDIR
#
#   1. train   train_tpfuse: a ~1.3B GPT (24 layers, hidden 2048, 16 heads, seq 2048, bf16, rope,
#              SwiGLU, RMSNorm, flash attention) for 30 iterations with the trainer on one GPU;
#              train_peer: the same model written plainly in PyTorch (benchmarks/plain_gpt_peer.py:
#              SDPA, torch.compile, fused AdamW) on the same batches from the same initial weights;
#              tokens/s, MFU (one formula: tpfuse.models.flops), peak memory, both loss curves;
#              train_tp2 / train_pp2: 2 processes sharing the GPU (gloo, --device cuda: the
#              collectives staged through host memory), the first iterations' losses against
#              the 1-process run
#   2. kernels gpu_check (matmul layouts vs cuBLAS, attention fwd / fwd+bwd vs SDPA's flash and
#              cuDNN backends, norms and cross-entropy in GB/s), attention_masks (documents,
#              window, decode vs SDPA), moe (grouped GEMM vs torch._grouped_mm); each validated
#              at the timed shape before it is timed
#   3. rest    generation (tokens/s of tpfuse-generate), context_parallel (cp attention work on
#              one GPU)
#
# OUTDIR gets summary.json (one entry per check: name, status ok / failed / skipped, seconds,
# limit_s, its key figures), summary.md (the table for benchmarks/RESULTS.md) and logs.tar.gz
# (every check's log and metrics; --keep-logs also leaves them in OUTDIR/logs). A check that fails
# or runs out of time never stops the next one. --dry-run runs every check at tiny shapes on the
# CPU (Triton's interpreter, gloo) so the script is exercised without a GPU, each check under 6 ×
# its device limit (summary.json's limit_s is the device limit). --only runs the named checks and
# lists the others as skipped.
#
# Runs from a source checkout: when `import tpfuse` fails it tries an editable install without
# build isolation, and failing that (no network, no build tools) maps the repository's folders
# onto the tpfuse namespace in a throw-away PYTHONPATH, as setup.py's package_dir does. Every
# check runs the interpreter $PYTHON (default python3, the first on PATH; the tests pass their own).
set -u
PYTHON=${PYTHON:-python3}
dry=0 keep=0 out= only=
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --keep-logs) keep=1 ;;
        --only) only=,$2,; shift ;;
        -*) echo "gpu_session.sh: unknown option $1" >&2; exit 2 ;;
        *) out=$1 ;;
    esac
    shift
done
if [ -z "$out" ]; then
    echo "usage: bash benchmarks/gpu_session.sh [--dry-run] [--keep-logs] [--only NAME,NAME] OUTDIR" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
logs=$out/logs
: > "$out/checks.tsv"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tpfuse_triton_cache}
work=$(mktemp -d)          # commands run here: the checkout's tpfuse/ folder must not shadow
cd "$work"

if ! "$PYTHON" -c "import tpfuse.kernels" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$repo" >/dev/null 2>&1 || true
fi
if ! "$PYTHON" -c "import tpfuse.kernels" 2>/dev/null; then
    mkdir -p "$work/path/tpfuse"
    for file in "$repo"/tpfuse/*; do ln -sf "$file" "$work/path/tpfuse/"; done
    for folder in "$repo"/*/; do
        name=$(basename "$folder")
        [ -f "$folder/__init__.py" ] && [ "$name" != tpfuse ] && [ "$name" != tests ] \
            && ln -sfn "$repo/$name" "$work/path/tpfuse/$name"
    done
    export PYTHONPATH="$work/path${PYTHONPATH:+:$PYTHONPATH}"
fi

gpus=0
if [ "$dry" = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
fi
{
    date -u '+%Y-%m-%d %H:%M UTC,' | tr '\n' ' '
    printf 'commit %s, ' "$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    "$PYTHON" -c "import torch, triton; print(torch.cuda.get_device_name() if torch.cuda.is_available()
                else 'CPU', '| torch', torch.__version__, 'cuda', torch.version.cuda,
                'triton', triton.__version__)"
} | tee "$out/versions.txt"
echo "GPUs: $gpus; dry run: $dry; output in $out"

check() {   # check NAME LIMIT_S COMMAND...: run it under `timeout`, record name, rc, seconds
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [ -n "$only" ] && [[ $only != *",$name,"* ]]; then
        skip "$name" "$limit" "not selected (--only)"
        return
    fi
    timeout -k 5 "$((limit * scale))" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$out/checks.tsv"
    echo "== $name: rc=$rc in $((SECONDS - start)) s (limit $((limit * scale)) s)"
    tail -n "${TAIL_LINES:-15}" "$logs/$name.log"
}
skip() {    # skip NAME LIMIT_S REASON
    printf '%s\tskip\t0\t%s\t%s\n' "$1" "$2" "$3" >> "$out/checks.tsv"
    echo "== $1: skipped ($3)"
}

bench=$repo/benchmarks
scale=1     # the dry run allows each check 6 × its device limit (Triton's interpreter on a CPU)
if [ "$dry" = 1 ]; then
    scale=6
    export TPFUSE_CACHE=${TPFUSE_CACHE:-$work/cache} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
           --seq-length 64 --max-position-embeddings 64 --vocab-size 250)
    train_iters=3 pair_iters=3 pair_device=()
    batch=(--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr-warmup-iters 1)
    precision=() peer_flags=(--no-compile) kernel_flag=--cpu-dry-run backend=gloo
else
    model=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
           --max-position-embeddings 2048 --vocab-size 50257)
    train_iters=30 pair_iters=2 pair_device=(--device cuda)
    batch=(--micro-batch-size 4 --global-batch-size 8 --train-iters 30 --lr-warmup-iters 5)
    precision=(--bf16) peer_flags=() kernel_flag= backend=nccl
fi
job=("${model[@]}" "${batch[@]}" "${precision[@]}" --swiglu --normalization RMSNorm
     --disable-bias-linear --position-embedding-type rope --attention-dropout 0
     --hidden-dropout 0 --mock-data --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
     --eval-iters 0 --eval-interval 100000 --log-interval 1 --no-progress-bar
     --log-throughput --peak-tflops 989.4 --tensor-model-parallel-size 1
     --pipeline-model-parallel-size 1)
train() {   # train NAME LIMIT_S NPROC EXTRA_FLAGS...: the trainer on the job, metrics to logs/
    local name=$1 limit=$2 nproc=$3
    shift 3
    check "$name" "$limit" "$PYTHON" -m tpfuse.training.launcher --nproc-per-node "$nproc" \
        "${job[@]}" --distributed-backend "$backend" --metrics-file "$logs/$name.jsonl" "$@"
}

# 1. training (300 s)
train train_tpfuse 120 1
check train_peer 120 "$PYTHON" "$bench/plain_gpt_peer.py" "${peer_flags[@]}" "${job[@]}" \
    --metrics-file "$logs/train_peer.jsonl"
# two ranks sharing the one GPU: NCCL refuses that, so gloo with the model on CUDA (--device cuda:
# each collective staged through host memory); the first iterations of the same job, same
# schedule (--lr-decay-iters of the 1-process run), against the 1-process losses
short=(--train-iters "$pair_iters" --lr-decay-iters "$train_iters" --distributed-backend gloo
       "${pair_device[@]}")
train train_tp2 30 2 "${short[@]}" --tensor-model-parallel-size 2
train train_pp2 30 2 "${short[@]}" --pipeline-model-parallel-size 2
# 2. kernels (185 s)
check gpu_check 80 "$PYTHON" "$bench/gpu_check.py" ${kernel_flag:---quick} --budget-s "$((65 * scale))" \
    --json "$logs/gpu_check.json"
check attention_masks 75 "$PYTHON" "$bench/gpu_attention_check.py" $kernel_flag
check moe 30 "$PYTHON" "$bench/gpu_moe_check.py" $kernel_flag
# 3. what remains (55 s)
check generation 35 "$PYTHON" "$bench/gpu_generation_check.py" $kernel_flag
check context_parallel 20 "$PYTHON" "$bench/gpu_context_parallel_check.py" $kernel_flag \
    --budget-s "$((14 * scale))"

"$PYTHON" "$bench/gpu_session_summary.py" "$out" --dry-run "$dry"
tar -czf "$out/logs.tar.gz" -C "$out" logs
[ "$keep" = 1 ] || rm -rf "$logs"
cat "$out/summary.md"
rm -rf "$work"
