#!/usr/bin/env bash
# Mixtral pretraining with TP x EP x DP on any CPU machine, from a fresh clone:
#   install -> build a synthetic packed dataset -> TP=2 x EP=2 (DP=2) pretraining with sequence parallelism on four
#   gloo processes (torchrun) -> resume its checkpoint at TP=2 x EP=1 -> merge it with nxdtp-merge -> load it with
#   transformers' AutoModelForCausalLM and generate -> the loss-curve check (TP=2 x EP=2 ZeRO-1 SP and TP=1 x EP=4
#   against dense).
#
#   bash examples/tp_ep_mixtral/demo.sh [WORK_DIR]        (default WORK_DIR: ./demo_output_mixtral)
#
# Environment: NXDTP_DEMO_STEPS (default 60), NXDTP_DEMO_VENV (default .venv; an active virtualenv is used as is),
# NXDTP_DEMO_SKIP_INSTALL=1 (use the active environment as it is: nxdtp and its "examples" extra already installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mkdir -p "${1:-demo_output_mixtral}" && cd "${1:-demo_output_mixtral}" && pwd)
steps=${NXDTP_DEMO_STEPS:-60}
example=examples/tp_ep_mixtral
start=$(date +%s)

stage() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

stage "1/7 install nxdtp with its example dependencies"
# shellcheck disable=SC1091
source examples/common/demo_install.sh
installed=$(date +%s)

stage "2/7 build a synthetic packed causal-LM dataset (64-token blocks, vocabulary 1024)"
rm -rf "$work/data"
python examples/tp_zero1_llama/build_llama_data.py --output_dir "$work/data" --synthetic --vocab_size 1024 \
    --seq_len 64 --num_blocks 4096

half=$(( steps / 2 ))
train() {   # train STOP TP EP: the Mixtral flow on four gloo processes up to step STOP, resuming from and saving
            # (every $half steps) to $work/pretrain/checkpoints
    python -m torch.distributed.run --standalone --nproc_per_node=4 $example/tp_ep_mixtral_pretrain.py \
        --model_path $example/configs/mixtral_tiny --data_dir "$work/data" --output_dir "$work/pretrain" \
        --metrics_file "$work/pretrain/results.json" --checkpoint_dir "$work/pretrain/checkpoints" \
        --checkpoint_freq "$half" --tensor_parallel_size "$2" --expert_parallel_size "$3" --batch_size 4 \
        --grad_accum_usteps 1 --seq_len 64 --lr 3e-3 --warmup_steps $(( steps / 10 + 1 )) --max_steps "$steps" \
        --steps_this_run "$1" --sequence_parallel_enabled --selective_checkpoint_enabled --print_grad_norm \
        --loading_step latest_if_exists --device cpu | grep -v '^\[Gloo\]'
}

stage "3/7 pretrain a tiny Mixtral (4 experts, top 2) for $half steps: TP=2 x EP=2 x DP=2, sequence parallel"
rm -rf "$work/pretrain"
train "$half" 2 2

stage "4/7 resume its checkpoint (every expert in each TP rank's file) at TP=2 x EP=1 for the other $half steps"
train "$steps" 2 1

stage "5/7 merge the TP=2 checkpoint into one Hugging Face checkpoint (nxdtp-merge)"
rm -rf "$work/merged"
nxdtp-merge "$work/pretrain/checkpoints" "$work/merged"

stage "6/7 load it with AutoModelForCausalLM.from_pretrained, score it and generate"
python examples/tp_zero1_llama/generate_merged.py "$work/merged" --data_dir "$work/data"

stage "7/7 loss curves: TP=2 x EP=2 ZeRO-1 SP and TP=1 x EP=4 against dense, same seed and global batch"
rm -rf "$work/loss_curve"
python $example/loss_curve.py --data_dir "$work/data" --output_dir "$work/loss_curve" --steps 12 \
    | grep -v '^\[Gloo\]'

end=$(date +%s)
cat <<DONE

=== done in $(( end - start ))s ($(( end - installed ))s after the install). Where everything went:
  dataset            $work/data  (packed_blocks.safetensors)
  training log       $work/pretrain/train_log.jsonl, metrics $work/pretrain/results.json
  sharded checkpoint $work/pretrain/checkpoints/step_$steps  (nxdtp_index.json, model/, optim/)
  merged checkpoint  $work/merged  (AutoModelForCausalLM.from_pretrained("$work/merged"))
  loss curves        $work/loss_curve/loss_curve.png  (numbers: loss_curve.json)
DONE
