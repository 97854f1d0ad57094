"""Where a run's wall time went: totals by kind over its metrics.jsonl, across restarts.

    bazel run //tools:goodput -- --run_dir=runs/ling2-tiny [--json]

Kinds and their meaning: `ling2.train.goodput`. Lost work is what restarts threw away (steps the
cut-short run had logged past the checkpoint the next run resumed from).
"""

import json
import math
import sys

from absl import app, flags

from ling2.config import cli
from ling2.config.paths import user_path
from ling2.data.jsonl import json_type
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


def check_values(rows: list[dict], path) -> None:
    """ValueError naming the file, step and field of a goodput value that is not a finite number of at least
    0 (seconds, lost steps): anything else would be a Python error, or totals that are silently wrong."""
    for r in rows:
        for k, v in r.items():
            if k.startswith("goodput/") and (isinstance(v, bool) or not isinstance(v, (int, float))
                                             or not math.isfinite(v) or v < 0):
                what = json_type(v) if isinstance(v, bool) or not isinstance(v, (int, float)) else v
                raise ValueError(f"{path}: step {r['step']}: {k} is {what}, not a finite number >= 0")


def main(argv):
    if len(argv) > 1 or not FLAGS.run_dir:
        print("error: usage: goodput --run_dir=DIR [--json]", file=sys.stderr)
        return 2
    path = user_path(FLAGS.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"error: {path}: no metrics.jsonl (not a trainer run directory?)", file=sys.stderr)
        return 2
    try:
        rows = read_metrics(path)
        check_values(rows, path)
        s = goodput.summary(rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cli.print_out(json.dumps(s, indent=1) if FLAGS.json else table(s))
    except OSError as e:  # stdout redirected to a full disk
        print(f"error: stdout: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
