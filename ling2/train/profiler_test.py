"""The step profiler: `profiler=xplane` leaves a trace of exactly the configured train steps under the run
directory, read back from its Chrome trace file (plain JSON, independent of the profiler's own readers);
off, it leaves nothing; bad settings are named."""

import gzip
import json

import jax
import pytest

from ling2.config import ConfigError, load_config
from ling2.train import loop
from ling2.train.data import make_iterator_factory
from ling2.train.testing import e2e
from ling2.train.train import find_file


def _run(run_dir, **over):
    cfg = load_config(*e2e.MICRO, "enable_checkpointing=false", config_file=find_file("configs/train/tiny_sample.yml"),
                      **{"steps": 5, **over})
    logs = []
    loop.run(cfg, run_dir, make_iterator_factory(find_file), log=logs.append, devices=jax.devices()[:1],
             tensorboard=False)
    return logs


def test_xplane_traces_the_configured_steps(tmp_path):
    logs = _run(tmp_path, profiler="xplane", profile_start_step=1, profile_steps=2)
    runs = list((tmp_path / "profile" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and list(runs[0].glob("*.xplane.pb"))
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "args" in e})
    assert steps == [2, 3]  # after 1 step (the compile), 2 steps
    assert any("train_step" in e.get("name", "") for e in events)  # the jitted step ran inside the trace
    assert any(line.startswith("profile: steps 2..3 traced in") for line in logs)


def test_off_by_default_and_bad_settings_named(tmp_path):
    _run(tmp_path, steps=2)
    assert not (tmp_path / "profile").exists()
    with pytest.raises(ConfigError, match="profiler"):
        load_config(profiler="nsys")
    with pytest.raises(ConfigError, match="profile_steps"):
        load_config(profile_steps=0)
