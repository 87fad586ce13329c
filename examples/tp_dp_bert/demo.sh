#!/usr/bin/env bash
# The README's main job, from a fresh clone on any CPU machine:
#   install -> build a synthetic dataset -> TP=2 pretraining with torchrun -> merge the checkpoint -> load it with
#   transformers -> the loss-curve check (TP=2 x DP=1 against TP=1 x DP=2) -> print where everything went.
#
#   bash examples/tp_dp_bert/demo.sh [WORK_DIR]        (default WORK_DIR: ./demo_output)
#
# Environment: NXDTP_DEMO_STEPS (default 40), NXDTP_DEMO_VENV (default .venv; an active virtualenv is used as is).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
work=$(mkdir -p "${1:-demo_output}" && cd "${1:-demo_output}" && pwd)
steps=${NXDTP_DEMO_STEPS:-40}
start=$(date +%s)

stage() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

stage "1/6 install nxdtp with its example dependencies"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    venv=${NXDTP_DEMO_VENV:-.venv}
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
fi
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[examples]"
export OMP_NUM_THREADS=1   # two ranks on a small machine: one thread each

stage "2/6 build a synthetic wikicorpus-format dataset"
rm -rf "$work/data"
python examples/tp_dp_bert/build_pretraining_data.py --output_dir "$work/data" --synthetic \
    --vocab_size 8192 --seq_len 128 --num_sequences 4096 --num_shards 2

stage "3/6 pretrain BERT-mini for $steps steps: tensor parallel 2, two gloo processes (torchrun)"
rm -rf "$work/pretrain"
python -m torch.distributed.run --standalone --nproc_per_node=2 \
    examples/tp_dp_bert/tp_dp_bert_large_hf_pretrain_hdf5.py \
    --data_dir "$work/data" --output_dir "$work/pretrain" --metrics_file "$work/pretrain/results.json" \
    --model_config examples/tp_dp_bert/configs/bert_mini --tensor_parallel_size 2 \
    --batch_size 16 --grad_accum_usteps 1 --lr 1e-3 --warmup_steps 4 --max_steps "$steps" \
    --steps_this_run "$steps" --shards_per_ckpt 0 --print_grad_norm

stage "4/6 merge the TP=2 checkpoint into one Hugging Face checkpoint"
rm -rf "$work/merged"
python tools/merge_checkpoints.py "$work/pretrain" "$work/merged"

stage "5/6 load it with transformers and score it"
python examples/tp_dp_bert/evaluate_merged.py "$work/merged" --data_dir "$work/data"

stage "6/6 loss curves: TP=2 x DP=1 against TP=1 x DP=2, same seed and global batch, dropout off"
rm -rf "$work/loss_curve"
python examples/tp_dp_bert/loss_curve.py --data_dir "$work/data" --output_dir "$work/loss_curve" --steps 20

elapsed=$(( $(date +%s) - start ))
cat <<EOF

=== done in ${elapsed}s. Where everything went:
  dataset            $work/data  (*_training_*.hdf5, vocab.txt, data_info.json)
  training log       $work/pretrain/train_log.jsonl, metrics $work/pretrain/results.json
  sharded checkpoint $work/pretrain/$(cat "$work/pretrain/newest")  (nxdtp_index.json, model/tp_rank_*.safetensors, optim/)
  merged checkpoint  $work/merged  (BertForPreTraining.from_pretrained("$work/merged"))
  loss curves        $work/loss_curve/loss_curve.png  (numbers: loss_curve.json)
EOF
