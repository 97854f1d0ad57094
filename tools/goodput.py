"""Where a run's wall time went: totals by kind over its metrics.jsonl, across restarts.

    bazel run //tools:goodput -- --run_dir=runs/ling2-tiny [--json]

Kinds and their meaning: `ling2.train.goodput`. Lost work is what restarts threw away (steps the
cut-short run had logged past the checkpoint the next run resumed from).
"""

import json
import sys

from absl import app, flags

from ling2.config import cli
from ling2.config.paths import user_path
from ling2.train import goodput
from ling2.train.metrics import read_metrics

flags.DEFINE_string("run_dir", None, "A trainer run directory (holding metrics.jsonl).")
flags.DEFINE_bool("json", False, "Print the totals as JSON.")
FLAGS = flags.FLAGS


def table(s: dict) -> str:
    rows = [(k, f"{s[k]:10.1f} s", f"{100 * s[k] / s['total']:5.1f} %" if s["total"] else "") for k in goodput.KINDS]
    rows += [("total", f"{s['total']:10.1f} s", ""), ("lost steps", f"{s['lost_steps']:10d}", ""),
             ("goodput", f"{100 * s['goodput']:9.1f} %", "(train steps / total)")]
    return "\n".join(f"{a:<12}{b:>14}  {c}" for a, b, c in rows)


def main(argv):
    if len(argv) > 1 or not FLAGS.run_dir:
        print("error: usage: goodput --run_dir=DIR [--json]", file=sys.stderr)
        return 2
    path = user_path(FLAGS.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"error: {path}: no metrics.jsonl (not a trainer run directory?)", file=sys.stderr)
        return 2
    try:
        s = goodput.summary(read_metrics(path))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if FLAGS.json else table(s))
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
