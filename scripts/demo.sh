#!/bin/sh
# The main job: set up and build; start astraid with its defaults (sqlite state, CPU slots);
# create a small model and a dataset from the text under /usr/share/common-licenses (byte
# tokenizer); submit a training job with astraictl, watch it train, pause it, resume it, and
# show its final status. Run as root on a fresh Debian 12 machine.
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
bin=$(pwd)/build
out=$(pwd)/demo
rm -rf "$out"
mkdir -p "$out"

# A small model and a dataset.
cat > "$out/model.json" <<'JSON'
{"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
 "num_key_value_heads": 2, "intermediate_size": 352, "rms_norm_eps": 1e-5,
 "rope_theta": 10000, "max_position_embeddings": 128, "tie_word_embeddings": true,
 "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": false, "use_gated_attention": false}
JSON
"$bin/astrai-model" init --config "$out/model.json" --out "$out/model" --seed 3407
"$bin/astrai-model" info "$out/model"
"$bin/astrai-data" prep --out "$out/data" --format text --tokenizer bytes /usr/share/common-licenses/*
"$bin/astrai-data" inspect "$out/data" --window_size 128

# The daemon, with its defaults, in the background; stopped when this script ends.
"$bin/astraid" > "$out/astraid.log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
ctl="$bin/astraictl"
for _ in $(seq 100); do "$ctl" daemon >/dev/null 2>&1 && break; sleep 0.1; done
"$ctl" daemon

cat > "$out/job.json" <<JSON
{"name": "licenses", "train_type": "seq", "param_path": "$out/model",
 "data_root_path": "$out/data", "ckpt_dir": "$out/ckpt", "n_epoch": 1,
 "batch_per_device": 8, "window_size": 128, "optimizer": "adamw", "max_lr": 2e-3,
 "weight_decay": 0.01, "ckpt_interval": 100, "nprocs": 1}
JSON
job=$("$ctl" submit "$out/job.json" | awk '{print $2}')
echo "submitted job $job"

state() { "$ctl" status "$job" --json | sed -n 's/.*"state":"\([a-z]*\)".*/\1/p'; }
step() { "$ctl" status "$job" --json | sed -n 's/.*"step":\([0-9]*\).*/\1/p'; }

# Watch it train for a while, then pause it.
until [ "$(step)" -ge 60 ] 2>/dev/null; do sleep 0.5; done &
watcher_until=$!
timeout 300 "$ctl" watch "$job" &
watcher=$!
wait $watcher_until
kill $watcher 2>/dev/null || true
echo
"$ctl" pause "$job"
until [ "$(state)" = paused ]; do sleep 0.2; done
echo "paused at step $(step); checkpoints:"
ls "$out/ckpt"
"$ctl" status "$job"

# Resume it from its checkpoint and watch it to the end.
"$ctl" resume "$job"
timeout 600 "$ctl" watch "$job"
echo
"$ctl" list
"$ctl" status "$job"
