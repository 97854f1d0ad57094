"""FP8 numerics experiment: the same run (bundled data, one seed, one data order) with bf16 matmuls and with
quantization=fp8 (per-tensor and block scaling), for ling2-tiny and ling3-tiny; train-loss curves and the
eval loss side by side. On a CPU (no FP8 units) fp8 is the emulation with the kernels' rounding
(ling2.kernels.fp8), so this measures numerics, not speed.

  bazel run //tools/bench/fp8:bench -- [--models ling2-tiny,ling3-tiny] [--modes bf16,fp8,fp8-block]
                                       [--steps 300] [--out FILE]

Each run's result is appended to the JSON as it finishes, so a partial sweep keeps what it measured.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from ling2.config import load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.train import find_file
from tools.bench.report import host_facts, results_path

MODES = {"bf16": {}, "fp8": {"quantization": "fp8", "fp8_scaling": "tensor"},
         "fp8-block": {"quantization": "fp8", "fp8_scaling": "block"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="ling2-tiny,ling3-tiny")
    ap.add_argument("--modes", default="bf16,fp8,fp8-block")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval_steps", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    out = results_path(a.out, "fp8", "results_cpu.json")
    work = Path(tempfile.mkdtemp(prefix="fp8_"))
    doc = {**host_facts(), "args": vars(a), "rows": []}
    make_iter = make_iterator_factory(find_file)
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            cfg = load_config(dict(model_name=model, dtype="bfloat16", steps=a.steps, log_period=10,
                                   eval_interval=a.steps // 3, eval_steps=a.eval_steps, checkpoint_period=a.steps,
                                   async_checkpointing=False, **MODES[mode]),
                              config_file=find_file("configs/train/tiny_sample.yml"))
            t0 = time.time()
            loop.run(cfg, work / f"{model}_{mode}", make_iter, tensorboard=False, log=lambda s: None)
            recs = [json.loads(line) for line in (work / f"{model}_{mode}" / "metrics.jsonl").read_text().splitlines()]
            row = {"model": model, "mode": mode, "train_s": time.time() - t0,
                   "loss": {r["step"]: r["loss"] for r in recs if "loss" in r},
                   "eval_loss": {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}}
            doc["rows"].append(row)
            doc["load_avg_end"] = host_facts()["load_avg"]
            last = row["eval_loss"][max(row["eval_loss"])]
            base = next((r for r in doc["rows"] if r["model"] == model and r["mode"] == "bf16"), None)
            row["eval_vs_bf16"] = last / base["eval_loss"][max(base["eval_loss"])] - 1 if base else None
            with open(out, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"{model:11s} {mode:10s} eval {last:.4f}"
                  + (f" ({row['eval_vs_bf16']:+.2%} vs bf16)" if base and base is not row else "")
                  + f"  train {row['loss'][max(row['loss'])]:.4f}  {row['train_s']:.0f} s", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
