"""Ling2 trainer: `bazel run //ling2/train:train -- [--config=FILE] [--run_dir=DIR] key=value ...`

With no arguments it trains ling2-tiny on the bundled sample data on CPU
(configs/train/tiny_sample.yml). Every config key can be overridden as key=value;
flags cover what is not model config. Exit status: 0 done (or stopped by a signal after
saving; --preempted_exit_code sets another status for that case), 2 bad input (one `error:` message
naming the file, field or path), 1 a bug.
"""

import sys
import traceback

from absl import app, flags

from ling2.config import cli
from ling2.config.paths import find_file, user_path

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/train/tiny_sample.yml",
                    "Root config file (relative paths: the working directory, then the repository).")
flags.DEFINE_string("run_dir", "runs/ling2-tiny", "Where checkpoints and metrics go (relative: the working directory).")
flags.DEFINE_bool("dry_run", False, "Compile the train step for the mesh from abstract state (no data, nothing "
                  "materialised), print memory per device, don't train.")
flags.DEFINE_integer("max_consecutive_skips", 5, "Stop after this many non-finite steps in a row.")
flags.DEFINE_bool("tensorboard", True, "Write TensorBoard event files next to metrics.jsonl.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-host (or LING2_COORDINATOR).")
flags.DEFINE_integer("num_processes", None, "Number of processes (or LING2_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", None, "This process's index (or LING2_PROCESS_ID).")
flags.DEFINE_integer("preempted_exit_code", 0, "Exit status after a signal stopped the run and its checkpoint was "
                     "saved, before its last step: a launcher tells a preemption (requeue) from the end "
                     "(tools/launch/slurm.sbatch sets 75).")

def main(argv):
    from absl import logging

    import jax

    from ling2.config import ConfigError, load_config
    from ling2.train import distributed
    from ling2.train.errors import TrainingError

    logging.set_verbosity(logging.WARNING)  # library INFO chatter (orbax) off; our own lines are printed
    try:
        distributed.maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    except TrainingError as e:
        print(f"error: bad flag: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(*argv[1:], config_file=find_file(FLAGS.config))
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2

    from ling2.checkpoint.safetensors_io import SafetensorsError
    from ling2.checkpoint.state import CheckpointError
    from ling2.train.data import DataError, make_iterator_factory
    from ling2.train.loop import run

    if cfg.load_parameters_path:
        cfg = cfg.model_copy(update={"load_parameters_path": str(user_path(cfg.load_parameters_path))})
    run_dir = user_path(FLAGS.run_dir)
    try:
        result = run(cfg, run_dir, make_iterator_factory(find_file), max_consecutive_skips=FLAGS.max_consecutive_skips,
                     dry_run_only=FLAGS.dry_run, tensorboard=FLAGS.tensorboard)
    except (DataError, CheckpointError, TrainingError, ConfigError, SafetensorsError) as e:
        first, _, detail = str(e).partition("\n")
        print(f"error: {type(e).__name__}: {first}", file=sys.stderr)
        if detail:
            print(detail, file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - a last resort that still says what happened
        traceback.print_exc()
        return 1
    if not FLAGS.dry_run and jax.process_index() == 0:
        print(f"checkpoints: {result.checkpoint_dir}")
        print(f"metrics:     {result.metrics_path} (TensorBoard: {result.run_dir / 'tensorboard'})")
    return FLAGS.preempted_exit_code if not FLAGS.dry_run and result.stopped_by_signal else 0


def parse_flags(argv):
    """The shared flag parsing (a bad flag exits 2), and the trainer's own flag checks."""
    rest = cli.parse_flags(argv)
    if FLAGS.max_consecutive_skips < 1:
        print(f"error: bad flag: --max_consecutive_skips must be >= 1, got {FLAGS.max_consecutive_skips}",
              file=sys.stderr)
        sys.exit(2)
    if not FLAGS.run_dir.strip():  # an unset shell variable: the run would fill the working directory
        print("error: bad flag: --run_dir is empty", file=sys.stderr)
        sys.exit(2)
    if not 0 <= FLAGS.preempted_exit_code <= 255:  # an exit status is a byte: 256 would read as 0, done
        print(f"error: bad flag: --preempted_exit_code must be in [0, 255], got {FLAGS.preempted_exit_code}",
              file=sys.stderr)
        sys.exit(2)
    return rest


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)
