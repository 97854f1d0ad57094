"""Metrics: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. Values are plain floats; nested dicts are flattened with '/'.
"""

import json
import math
import time
from pathlib import Path

import jax


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = float(v)
    return out


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a")
            if tensorboard:
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict):
        if not self.enabled:
            return
        flat = flatten(metrics)
        rec = {"step": int(step), "time": time.time(), **{k: (v if math.isfinite(v) else str(v)) for k, v in flat.items()}}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, step)

    def close(self):
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def progress_line(step: int, total: int, m: dict, eta_s: float) -> str:
    """One human line per log interval."""
    eta = f"{int(eta_s // 3600)}:{int(eta_s % 3600 // 60):02d}:{int(eta_s % 60):02d}"
    return (f"step {step}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | tok/s {m['tokens_per_s']:,.0f} | "
            f"MFU {100 * m['mfu']:.2f}% | ETA {eta} | data wait {100 * m['data_wait_frac']:.1f}%")
