"""Metrics: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. Values are plain floats (non-finite ones as the strings "nan", "inf",
"-inf", which JSON cannot hold); nested dicts are flattened with '/'. `read_metrics` is the
one reader. A run that starts at step S (resumed, or 0) first drops the records of later steps,
left by the run it continues (`truncate_metrics`), and asks TensorBoard to hide its events
past S (tensorboardX's purge marker). Both files are written on the loop's thread, so a full disk
is one named error there (`write_error`).
"""

import json
import math
import time
from pathlib import Path

import jax

from ling2.config.paths import replaced, write_failure
from ling2.train.errors import TrainingError


NON_FINITE = ("nan", "inf", "-inf")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = float(v)
    return out


def parse_record(line: str) -> dict:
    """One metrics.jsonl line as its record: a JSON object with an integer `step`. Raises ValueError saying
    why a line is not one (a write cut short by a kill or a full disk, or damage)."""
    rec = json.loads(line)  # JSONDecodeError is a ValueError
    if not isinstance(rec, dict):
        raise ValueError(f"a JSON {type(rec).__name__}, not an object")
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"'step' is {step!r}, not an integer")
    return rec


def truncate_metrics(path, last_step: int) -> int:
    """Rewrites a metrics.jsonl to hold only records of steps up to `last_step`, in increasing step order and each
    ending its line: records of later steps, lines that are not records and records out of order (a step again,
    or an earlier one) go, and a last line cut before its newline gets one, so the next record starts a line.
    Returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8", errors="replace")  # garbage: not a record
    keep, dropped, last = [], 0, None
    for line in text.splitlines():
        try:
            step = parse_record(line)["step"]
        except ValueError:
            step = None
        if step is not None and step <= last_step and (last is None or step > last):
            keep.append(line + "\n")
            last = step
        elif line.strip():
            dropped += 1
    if dropped or "".join(keep) != text:
        with replaced(path) as f:
            f.write("".join(keep))
    return dropped


def write_error(path, what: str, e: OSError) -> TrainingError:
    """One line for a metrics file that cannot be written (a full disk named as such)."""
    return TrainingError(f"{path}: {what} failed: {write_failure(e)}; the run stops here and resumes from its "
                         "newest checkpoint once the file can be written")


class _Events:
    """A TensorBoard event file written on the caller's thread (tensorboardX's own writer runs a thread and an atexit
    flush, whose errors on a full disk are tracebacks after the run has stopped). A run starting at step S writes
    tensorboardX's purge marker: a SessionLog START at S + 1 hides the events a cut-short run logged past S."""

    FLUSH_S = 10.0

    def __init__(self, logdir: Path, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._event = Event
        logdir.mkdir(parents=True, exist_ok=True)
        self._w = EventsWriter(str(logdir / "events"))
        self._w.write_event(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
        self._w.write_event(Event(wall_time=time.time(), step=purge_step,
                                  session_log=SessionLog(status=SessionLog.START)))
        self._w.flush()
        self._flushed = time.monotonic()

    def scalars(self, step: int, values: dict) -> None:
        from tensorboardX.summary import scalar

        t = time.time()
        for k, v in values.items():
            self._w.write_event(self._event(wall_time=t, step=step, summary=scalar(k, v)))
        if time.monotonic() - self._flushed > self.FLUSH_S:
            self._w.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._w.close()


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, start_step: int = 0):
        """Appends to run_dir/metrics.jsonl (and TensorBoard events) for a run starting at `start_step`. The file
        is unbuffered: a record is written whole by `write` or raises there, and nothing is left to flush later."""
        self.enabled = jax.process_index() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb_dir = Path(run_dir) / "tensorboard"
        self._tb = None
        if self.enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                truncate_metrics(self.path, start_step)
                self._f = open(self.path, "ab", buffering=0)
            except OSError as e:
                raise write_error(self.path, "opening the metrics file", e) from None
            if tensorboard:
                try:
                    self._tb = _Events(self.tb_dir, start_step + 1)
                except OSError as e:
                    raise write_error(self.tb_dir, "opening the TensorBoard event file", e) from None

    def write(self, step: int, metrics: dict):
        if not self.enabled:
            return
        flat = flatten(metrics)
        rec = {"step": int(step), "time": time.time(), **{k: (v if math.isfinite(v) else str(v)) for k, v in flat.items()}}
        data = memoryview((json.dumps(rec) + "\n").encode())
        try:
            while data:
                data = data[self._f.write(data):]
        except OSError as e:
            raise write_error(self.path, f"writing the record of step {step}", e) from None
        if self._tb is not None:
            try:
                self._tb.scalars(step, flat)
            except OSError as e:
                raise write_error(self.tb_dir, f"writing the TensorBoard events of step {step}", e) from None

    def close(self):
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                try:
                    self._tb.close()
                except OSError as e:
                    raise write_error(self.tb_dir, "closing the TensorBoard event file", e) from None


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl, one per step in step order (a resumed run's later record of a
    step wins), with the non-finite values written as strings ("nan", "inf") back as floats.

    Raises ValueError naming the file and line of a malformed record, or an empty file."""
    path = Path(path)
    last = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})") \
            from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = parse_record(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a metrics record ({e})") from None
        last[rec["step"]] = {k: float(v) if v in NON_FINITE else v for k, v in rec.items()}
    if not last:
        raise ValueError(f"{path}: no metrics")
    return [last[s] for s in sorted(last)]


def progress_line(step: int, total: int, m: dict, eta_s: float) -> str:
    """One human line per log interval."""
    eta = f"{int(eta_s // 3600)}:{int(eta_s % 3600 // 60):02d}:{int(eta_s % 60):02d}"
    return (f"step {step}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | tok/s {m['tokens_per_s']:,.0f} | "
            f"MFU {100 * m['mfu']:.2f}% | ETA {eta} | data wait {100 * m['data_wait_frac']:.1f}%")
