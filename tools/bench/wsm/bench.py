"""WSM experiment: the same run (ling2-tiny on the bundled data, one seed, one data order) under cosine decay,
WSD (warmup-stable-decay) and constant rate + checkpoint merging (wsm), eval loss side by side.

Each schedule trains --steps steps saving every --period steps; the wsm run is then merged over its newest
k checkpoints (`//ling2/checkpoint:merge`'s math) for each --windows k and --shapes shape, and every model is
evaluated on the same --eval_steps validation batches. Prints a table and writes JSON.

  bazel run //tools/bench/wsm:bench -- [--steps 300] [--period 20] [--windows 3,6] [--out FILE]
"""

import argparse
import json
import tempfile
import time
import types
from pathlib import Path

import jax
from flax import nnx

from ling2.checkpoint import merge as M
from ling2.checkpoint.state import load_state
from ling2.config import load_config
from ling2.layers.model import Ling2Model
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.eval import Evaluator
from ling2.train.runtime import make_mesh
from ling2.train.train import find_file
from ling2.layers.spec import ModelSpec
from tools.bench.report import host_facts, write_results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--period", type=int, default=20)
    ap.add_argument("--windows", default="3,6")
    ap.add_argument("--shapes", default="uniform,cosine,1-sqrt")
    ap.add_argument("--eval_steps", type=int, default=8)
    ap.add_argument("--wsd_fraction", type=float, default=0.2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wsm_"))
    common = dict(steps=a.steps, checkpoint_period=a.period, max_checkpoints_to_keep=a.steps // a.period + 1,
                  eval_interval=a.steps, eval_steps=a.eval_steps, log_period=50, async_checkpointing=False,
                  final_lr_fraction=0.0, wsd_decay_steps_fraction=a.wsd_fraction)
    make_iter = make_iterator_factory(find_file)
    rows, cfgs = [], {}
    for sched in ("cosine", "wsd", "wsm"):
        cfg = load_config(common, lr_schedule=sched, config_file=find_file("configs/train/tiny_sample.yml"))
        t0 = time.time()
        res = loop.run(cfg, work / sched, make_iter, tensorboard=False, log=lambda s: None)
        recs = [json.loads(line) for line in (work / sched / "metrics.jsonl").read_text().splitlines()]
        ev = [r["eval_loss"] for r in recs if "eval_loss" in r][-1]
        rows.append({"model": f"{sched} (step {a.steps})", "eval_loss": ev, "train_loss": res.losses[a.steps],
                     "train_s": time.time() - t0})
        cfgs[sched] = cfg
    cfg = cfgs["wsm"]
    mesh = make_mesh(cfg, jax.devices()[:1])
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    evaluator = Evaluator(cfg, mesh, nnx.split(model, nnx.Param, ...)[0], make_iter)
    for k in (int(x) for x in a.windows.split(",")):
        dirs = M.step_dirs_of(work / "wsm", last=k)
        for shape in a.shapes.split(","):
            out = M.merge(dirs, M.decay_coefficients(shape, k), work / f"merged_{k}_{shape}", log=lambda s: None)
            state = nnx.state(model)
            nnx.replace_by_pure_dict(state, load_state(out, cfg))
            _, params, rest = nnx.split(nnx.merge(nnx.graphdef(model), state), nnx.Param, ...)
            loss = evaluator.evaluate(types.SimpleNamespace(params=params, rest=rest))
            rows.append({"model": f"wsm + merge of the last {k} ({k * a.period} steps), {shape}", "eval_loss": loss,
                         "merged_steps": [int(d.name) for d in dirs]})
    print(f"ling2-tiny, {a.steps} steps, checkpoints every {a.period}, eval on {a.eval_steps} validation batches")
    print(f"{'model':58s} {'eval loss':>9s}")
    for r in rows:
        print(f"{r['model']:58s} {r['eval_loss']:9.4f}")
    write_results({**host_facts(), "args": vars(a), "rows": rows}, a.out, "wsm", "results_cpu.json")


if __name__ == "__main__":
    main()
