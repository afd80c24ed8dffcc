#!/bin/sh
# The main job: set up, build, create a small model and a dataset from the text
# under /usr/share/common-licenses (byte tokenizer), and train it on the CPU.
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null

out=demo
rm -rf "$out"
mkdir -p "$out"
cat > "$out/model.json" <<'JSON'
{"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
 "num_key_value_heads": 2, "intermediate_size": 352, "rms_norm_eps": 1e-5,
 "rope_theta": 10000, "max_position_embeddings": 128, "tie_word_embeddings": true,
 "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": false, "use_gated_attention": false}
JSON
build/astrai-model init --config "$out/model.json" --out "$out/model" --seed 3407
build/astrai-model info "$out/model"
build/astrai-data prep --out "$out/data" --format text --tokenizer bytes /usr/share/common-licenses/*
build/astrai-data inspect "$out/data" --window_size 128
build/astrai-train --train_type=seq --param_path="$out/model" --data_root_path="$out/data" \
    --n_epoch=1 --batch_per_device=8 --window_size=128 --max_lr=2e-3 \
    --optimizer=adamw --weight_decay=0.01 --warmup_ratio=0.05 --ckpt_interval=100 \
    --ckpt_dir="$out/ckpt" --log_interval=20
echo "checkpoints:"
ls "$out/ckpt"
echo "progress database (first and last steps):"
sqlite3 -header -column "$out/ckpt/progress.db" \
    "SELECT step, epoch, printf('%.4f', loss) AS loss, printf('%.2e', lr) AS lr,
            printf('%.0f', tokens_per_s) AS tok_per_s FROM steps
     WHERE step IN (1, (SELECT max(step) FROM steps));"
