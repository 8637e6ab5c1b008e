#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py, patched with patches/megatron-lm-core_v0.16.1/dynatrain.patch,
# training a small Llama-style GPT on mock data with --dynatrain: switch its layout while it
# trains with `dynatrain request --signal-file $JOB_DIR/switch.json --layout tp1pp2dp4`.
#
#   MEGATRON_LM=/path/to/Megatron-LM NPROC=8 bash scripts/launch_megatron_lm_example.sh
#
# Needs GPUs (Megatron-LM's pretrain() is CUDA-only) and this package installed in the same
# Python (`pip install -e .`). The model flags are the ones the adapter can rebuild after a
# switch (megatron_lm/adapter.py:unsupported_args): distributed optimizer, no dropout,
# --transformer-impl matching what our builder will use. Flag names are those of the
# Megatron-LM commit the patch was checked against; other releases may spell some differently.
set -euo pipefail

MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout with the dynatrain patch applied}
NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
JOB_DIR=${JOB_DIR:-/tmp/dynatrain-mlm-job}
PYTHON=${PYTHON:-python}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if ! grep -qs "dynatrain_lm.dynatrain_step" "$MEGATRON_LM/megatron/training/training.py"; then
    echo "the dynatrain patch is not applied to $MEGATRON_LM; run:" >&2
    echo "  dynatrain megatron-lm patch $MEGATRON_LM" >&2
    exit 2
fi

# our builder uses Transformer Engine layers exactly when TE imports and CUDA is present;
# Megatron-LM must have built the first layout the same way
if "$PYTHON" -c "import torch, transformer_engine; assert torch.cuda.is_available()" 2>/dev/null; then
    IMPL=transformer_engine
else
    IMPL=local
fi

mkdir -p "$JOB_DIR"
cd "$MEGATRON_LM"
exec torchrun --nproc_per_node "$NPROC" pretrain_gpt.py \
    --transformer-impl "$IMPL" \
    --num-layers 8 --hidden-size 512 --ffn-hidden-size 1536 --num-attention-heads 8 \
    --group-query-attention --num-query-groups 4 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --swiglu --normalization RMSNorm --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --bf16 --use-distributed-optimizer \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --micro-batch-size 2 --global-batch-size 64 \
    --train-iters 200 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
    --eval-iters 0 --eval-interval 1000 --log-interval 1 \
    --dynatrain \
    --dynatrain-signal-file "$JOB_DIR/switch.json" \
    --dynatrain-log-dir "$JOB_DIR" \
    --dynatrain-ranks-per-node "$NPROC" \
    "$@"
