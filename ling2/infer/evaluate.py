"""Loss and perplexity of a Ling2 checkpoint on Megatron data:

    bazel run //ling2/infer:evaluate -- --ckpt=DIR --data_path=PREFIX_OR_BLEND [--split=valid] [--max_batches=N]
        [--out=FILE] [key=value ...]

DIR as for //ling2/infer:generate. --data_path is a .bin/.idx prefix or a Megatron blend
"w1 prefix1 w2 prefix2"; the split, sample order, batch size and sequence length are the
checkpoint config's (override with key=value, e.g. per_device_batch_size=4). --max_batches
defaults to the config's eval_steps, so on the training data the loss is the trainer's
eval_loss. Prints a table (overall and per blend component) and the JSON, written to --out
when given. Bad input exits 2.
"""

import json
import sys
from pathlib import Path

from absl import app, flags

from ling2.config import cli
from ling2.config.paths import check_writable, replaced, user_path

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint directory: trainer run or step, Ling2 state, or Hugging Face.")
flags.DEFINE_string("data_path", None, "A .bin/.idx prefix or a blend 'w1 prefix1 w2 prefix2 ...'.")
flags.DEFINE_string("split", "valid", "train, valid or test (the checkpoint config's data_split).")
flags.DEFINE_integer("max_batches", None, "Global batches to evaluate (default: the config's eval_steps).")
flags.DEFINE_string("out", None, "Write the JSON result here.")


def table(res: dict) -> str:
    rows = [("all", None, res)] + [(c["prefix"], c["weight"], c) for c in res["components"]]
    lines = [f"{'data':<48} {'weight':>7} {'tokens':>10} {'loss':>8} {'ppl':>10}"]
    for name, w, r in rows:
        lines.append(f"{name[-48:]:<48} {'' if w is None else f'{w:.3f}':>7} {int(r['tokens']):>10} "
                     f"{r['loss']:>8.4f} {r['perplexity']:>10.2f}")
    return "\n".join(lines)


def check_out(out: Path) -> None:
    """InferError naming --out when the result could not be written there, found before the evaluation runs
    (`paths.check_writable`)."""
    from ling2.infer.load import InferError

    try:
        check_writable(out)
    except ValueError as e:
        raise InferError(f"--out={e}") from None


def write_out(out: Path, text: str) -> None:
    """Writes `text` to `out` whole or not at all (`paths.replaced`: a full disk or a kill leaves the previous
    `out`, never a cut-short JSON), InferError naming --out when that fails."""
    from ling2.infer.load import InferError

    try:
        with replaced(out) as f:
            f.write(text)
    except OSError as e:
        raise InferError(f"--out={out}: cannot write: {e.strerror or e}") from None


def main(argv):
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # orbax warns of the step's item-level metadata file it does not need
    from ling2.infer.evaluation import evaluate
    from ling2.infer.load import InferError, find_file, load_model, print_out

    try:
        if not FLAGS.ckpt:
            raise InferError("--ckpt is required (a run, step, state or Hugging Face directory)")
        if not FLAGS.data_path:
            raise InferError("--data_path is required (a .bin/.idx prefix or a blend)")
        out = user_path(FLAGS.out) if FLAGS.out else None
        if out is not None:
            check_out(out)
        loaded = load_model(user_path(FLAGS.ckpt), *argv[1:])
        res = evaluate(loaded.model, loaded.cfg, FLAGS.data_path, find_file, FLAGS.split, FLAGS.max_batches,
                       log=lambda s: print(s, file=sys.stderr))
        res["ckpt"] = str(loaded.path)
        print_out(table(res))
        text = json.dumps(res, indent=2)
        if out is not None:
            write_out(out, text + "\n")
        print_out(f"wrote {out}" if out is not None else text)
    except InferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
