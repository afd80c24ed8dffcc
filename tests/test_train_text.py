"""A small model trained on real text (files under /usr/share/common-licenses, byte tokenizer)
gets its loss well below the uniform log(256) within a few hundred steps."""

import glob
import math
import os
import sys

import train_util as tu

CONFIG = dict(tu.SMALL_CONFIG, hidden_size=128, num_hidden_layers=3, intermediate_size=352,
              max_position_embeddings=64, tie_word_embeddings=True, use_qk_norm=False,
              use_gated_attention=False)


def main():
    root = tu.tmpdir()
    model = tu.make_model(root, CONFIG)
    data = os.path.join(root, "data")
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files = [f for f in files if os.path.isfile(f)]
    tu.run([tu.binary("astrai-data"), "prep", "--out", data, "--format", "text",
            "--tokenizer", "bytes"] + files)
    ckpt = os.path.join(root, "ckpt")
    tu.train({"train_type": "seq", "param_path": model, "data_root_path": data,
              "batch_per_device": 8, "window_size": 64, "ckpt_dir": ckpt, "max_steps": 300,
              "optimizer": "adamw", "max_lr": 3e-3, "weight_decay": 0.01, "threads": 2})
    rows = tu.metric_rows(tu.latest_checkpoint(ckpt))
    first = rows[0]["loss"]
    last = sum(r["loss"] for r in rows[-20:]) / 20
    print(f"{len(rows)} steps: loss {first:.3f} -> {last:.3f} (uniform {math.log(256):.3f})")
    if len(rows) != 300:
        print(f"FAIL: {len(rows)} steps, expected 300")
        return 1
    if not (abs(first - math.log(256)) < 0.5 and last < 0.6 * math.log(256)):
        print("FAIL: the loss did not fall well below log(256)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
