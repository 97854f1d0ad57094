"""The step profiler: a JAX trace (xplane) of a few train steps under the run directory.

`profiler: xplane` traces cfg.profile_steps steps starting after cfg.profile_start_step steps,
into run_dir/profile (one `plugins/profile/<time>/<host>.xplane.pb` per host, and a Chrome
`.trace.json.gz` beside it), for TensorBoard's profile plugin or xprof. Every train step runs under
`jax.profiler.StepTraceAnnotation("train", step_num=...)`, so the trace shows step boundaries.
"""

import contextlib
from pathlib import Path

import jax


class StepProfiler:
    def __init__(self, cfg, run_dir, log):
        self.on = cfg.profiler == "xplane"
        self.start, self.steps = cfg.profile_start_step, cfg.profile_steps
        self.dir, self.log, self.active = Path(run_dir) / "profile", log, False

    def step(self, step: int):
        """A context for running train step number `step` + 1 (after `step` steps): starts the trace on the
        configured step and annotates the step."""
        if self.on and step == self.start and not self.active:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir))
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step + 1) if self.active else contextlib.nullcontext()

    def after(self, step: int, state, *, last: bool = False):
        """After `step` steps: stops the trace once its steps have run (or at the run's end), waiting for them."""
        if self.active and (step >= self.start + self.steps or last):
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profile: steps {self.start + 1}..{step} traced in {self.dir}")
