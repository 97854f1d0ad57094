"""Goodput: where a run's wall time went, by kind, in metrics.jsonl and across restarts.

Each logged record carries the seconds of its window (since the previous record of this process)
spent on each kind:
  goodput/compile_s     the first step of a process (tracing and XLA compile);
  goodput/step_s        train steps after it (device compute as the host sees it);
  goodput/data_wait_s   waiting for the next batch;
  goodput/checkpoint_s  saving (the part the loop waits for; async writes overlap steps);
  goodput/restore_s     reading the checkpoint a run resumes from;
  goodput/eval_s        evaluation;
  goodput/lost_s        work lost to a restart: the records past the restored step, written by the run
                        that was cut short, which the resumed run drops (and replays); with
  goodput/lost_steps    how many steps those were.
The first record of a process holds its compile, restore and lost time. `summary` reads a run
directory's metrics.jsonl (all its processes, across restarts) into totals; goodput is step time over
the total.
"""

import contextlib
import math
import time
from pathlib import Path

from ling2.train.metrics import parse_record

KINDS = ("compile", "step", "data_wait", "checkpoint", "restore", "eval", "lost")


class Goodput:
    """Seconds by kind for the current logging window, and for the whole process. `clock` gives seconds
    (a monotonic one: `time.perf_counter`)."""

    def __init__(self, clock=time.perf_counter):
        self.window = dict.fromkeys(KINDS, 0.0)
        self.total = dict.fromkeys(KINDS, 0.0)
        self.lost_steps = 0
        self.clock = clock

    def add(self, kind: str, seconds: float):
        self.window[kind] += seconds
        self.total[kind] += seconds

    @contextlib.contextmanager
    def timed(self, kind: str | None):
        """Charges the time the `with` body takes to `kind` once it completes (a body that raises ends the
        run, so it charges nothing). None charges no kind: for a phase that is counted only sometimes."""
        t0 = self.clock()
        yield
        if kind is not None:
            self.add(kind, self.clock() - t0)

    def summary(self) -> dict:
        """This process's totals, as `summary` gives a run's."""
        return summary([{f"goodput/{k}_s": v for k, v in self.total.items()}])

    def take(self) -> dict:
        """The window's record fields; starts a new window."""
        out = {f"goodput/{k}_s": v for k, v in self.window.items()}
        if self.lost_steps:
            out["goodput/lost_steps"], self.lost_steps = float(self.lost_steps), 0
        self.window = dict.fromkeys(KINDS, 0.0)
        return out


def lost_work(path, restored_step: int) -> tuple[float, int]:
    """(seconds, steps) recorded in metrics.jsonl after `restored_step`: the work a resumed run replays.
    Read before the writer drops those records; lines that are not records (a write cut by a kill) and values
    that are not finite numbers count nothing."""
    path = Path(path)
    if not path.is_file():
        return 0.0, 0
    seconds, last = 0.0, restored_step
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = parse_record(line)
        except ValueError:
            continue
        if rec["step"] > restored_step:
            values = (rec.get(f"goodput/{k}_s") for k in KINDS)
            seconds += sum(v for v in values if isinstance(v, (int, float)) and math.isfinite(v))
            last = max(last, rec["step"])
    return seconds, last - restored_step


def summary(records: list[dict]) -> dict:
    """Totals by kind over a run's records (`ling2.train.metrics.read_metrics`), their sum, and goodput."""
    out = {k: sum(float(r.get(f"goodput/{k}_s", 0.0)) for r in records) for k in KINDS}
    out["lost_steps"] = int(sum(float(r.get("goodput/lost_steps", 0.0)) for r in records))
    out["total"] = sum(out[k] for k in KINDS)
    out["goodput"] = out["step"] / out["total"] if out["total"] else 0.0
    return out


def summary_line(s: dict) -> str:
    parts = ", ".join(f"{k} {s[k]:.1f}s" for k in KINDS if s[k])
    return f"goodput: {100 * s['goodput']:.1f}% of {s['total']:.1f}s in train steps ({parts})"
