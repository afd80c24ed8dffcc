"""test_layering: the folder layers of CMakeLists.txt hold at link time.

Every layer's check program (its library linked whole with only the layers it declares) was
built and runs; the deliberate violation, a unit in ckpt's layer calling the engine's
optim_muon_owns and train's pp_schedule_peak_held, fails to link naming both symbols."""
import os
import subprocess
import sys

import train_util as tu

BUILD = os.environ["ASTRAI_BUILD"]


def main():
    failures = []
    layers = sys.argv[1].split(",")
    for name in layers:
        exe = os.path.join(BUILD, f"layer_check_{name}")
        rc = subprocess.run([exe]).returncode if os.path.exists(exe) else None
        if rc != 0:
            failures.append(f"layer_check_{name}: {'missing' if rc is None else f'exit {rc}'}")
    print(f"{len(layers)} layer checks built and run: {', '.join(layers)}")
    proc = subprocess.run(["cmake", "--build", BUILD, "--target", "layer_check_layer_violation"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "undefined reference to" in line]
    named = [s for s in ("optim_muon_owns", "pp_schedule_peak_held")
             if any(s in line for line in lines)]
    print(f"ckpt calling up into engine and train: build exit {proc.returncode}, undefined "
          f"references named: {named}")
    if proc.returncode == 0 or len(named) != 2:
        failures.append(f"the upward calls linked or were not named: exit {proc.returncode}\n"
                        f"{out[-2000:]}")
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
