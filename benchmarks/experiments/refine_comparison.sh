#!/usr/bin/env bash
# What MePo's refine gives downstream (docs/results.md, "Does the refine lift the ceiling?"): three backbones (the untouched
# DINOv2 ViT-S/14, plain supervised fine-tuning, the paper's Meta Rep; both refines with the stem frozen, at the
# same images and steps), each with its offline heads, the default learner without and with Meta Cov, and MISA
# with the fixes without and with ISA prompts, on the Tiny-ImageNet downstream half and CIFAR-10, seeds 1-3; plus
# fine-tuning at twice the budget with the default learner; and Table 1 (every host, Tiny-ImageNet) with each refine.
#
#   bash benchmarks/experiments/refine_comparison.sh [RUNS] [STAGE] [DATASETS]
#
# RUNS defaults to runs/refine_comparison. STAGE "base" does only what needs no refined backbone (its Sigma_pre,
# ISA prompts and evaluations), e.g. while the refines run; "table1" only Table 1 and its ablation (every host, with
# each refine as Meta Rep, Meta Cov with the untouched Sigma_pre, and both); "all" (default) everything. DATASETS defaults to
# "tinyimagenet cifar10"; two invocations with one dataset each share the bundles and run side by side.
# Every step is resumable: refines continue from their checkpoint, finished bundles are kept, finished evaluation
# runs come from the dataset's shared cache. Evaluations run most informative first (the default learner, then
# MISA, then MISA with ISA prompts).
set -euo pipefail
RUNS=${1:-runs/refine_comparison}
STAGE=${2:-all}
DATASETS=${3:-tinyimagenet cifar10}
MEPO=${MEPO:-.venv/bin/mepo}
mkdir -p "$RUNS"
COMMON=(--backbone.img_size 84)
ISA=(--data.train_per_class 10 --adapt.lr 1e-4 --adapt.epochs 1)

[ -f "$RUNS/cov_base/manifest.json" ] || "$MEPO" covariance --out "$RUNS/cov_base" "${COMMON[@]}" \
    --cov.data.train_per_class 100
refine() {  # name mode meta-epochs: a refined bundle with Sigma_pre, resumable
    [ -f "$RUNS/$1/manifest.json" ] || "$MEPO" refine --out "$RUNS/$1" --loop.mode "$2" "${COMMON[@]}" \
        --tasks.samples_per_class 100 --loop.meta_epochs "$3" --cov.data.train_per_class 100 --adapt.skip true \
        --resume true
}
MODES=()  # the same budget: one meta-epoch each; finetune2 (default learner only) has twice the budget
if [ "$STAGE" != base ]; then
    MODES=(finetune meta)
    refine finetune finetune 1
    refine meta meta 1
    refine finetune2 finetune 2
fi

isa_prompts() {  # backbone-name [bundle]: ISA prompts for that backbone, made once (locked: datasets run side by side)
    (
        flock 9
        [ -f "$RUNS/isa_$1/manifest.json" ] || "$MEPO" isa --out "$RUNS/isa_$1" "${COMMON[@]}" "${ISA[@]}" ${2:+--mepo "$2"}
    ) 9>"$RUNS/.isa_$1.lock"
}

evaluate() {  # dataset-name out-name extra-flags...: one sweep into its own folder, sharing the dataset's cache
    local name=$1 out=$RUNS/eval/$1/$2; shift 2
    mkdir -p "$out" "$RUNS/eval/$name/cache"
    ln -sfn "$(realpath "$RUNS/eval/$name/cache")" "$out/cache"
    "$MEPO" evaluate --out "$out" --seed 1-3 "${COMMON[@]}" --learner.train_encoder false \
        --protocol.eval_period 250 "${DATA[@]}" "$@"
}

table1() {  # every host of Table 1 with each same-budget refine, ablation included (Tiny-ImageNet)
    DATA=(--data.dataset tinyimagenet-downstream --data.train_per_class 25 --data.test_per_class 10)
    for mode in meta finetune; do
        evaluate tinyimagenet "table1_$mode" --method frozen,misa,dualprompt,deep_l2p,coda_p,mvp \
            --mepo "$RUNS/$mode" --mepo_cov "$RUNS/cov_base" --ablation true
    done
}
if [ "$STAGE" = table1 ]; then table1; exit 0; fi

for name in $DATASETS; do
    if [ "$name" = tinyimagenet ]; then
        DATA=(--data.dataset tinyimagenet-downstream --data.train_per_class 25 --data.test_per_class 10)
    else
        DATA=(--data.dataset cifar10 --data.train_per_class 100 --data.test_per_class 50)
    fi
    evaluate "$name" frozen_base --method frozen
    evaluate "$name" frozen_cov_base --method frozen --mepo_cov "$RUNS/cov_base"
    for mode in "${MODES[@]}" ${MODES[@]:+finetune2}; do
        evaluate "$name" "frozen_$mode" --method frozen --mepo "$RUNS/$mode" --mepo_cov "$RUNS/cov_base" \
            --ablation true
    done
    evaluate "$name" misa_base --method misa
    for mode in "${MODES[@]}"; do
        evaluate "$name" "misa_$mode" --method misa --mepo_rep "$RUNS/$mode"
    done
    isa_prompts base
    evaluate "$name" misa_isa_base --method misa --mepo_prompts "$RUNS/isa_base"
    for mode in "${MODES[@]}"; do
        isa_prompts "$mode" "$RUNS/$mode"
        evaluate "$name" "misa_isa_$mode" --method misa --mepo_rep "$RUNS/$mode" --mepo_prompts "$RUNS/isa_$mode"
    done
done
[ "$STAGE" = base ] || table1
