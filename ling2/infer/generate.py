"""Generate text from a Ling2 checkpoint:

    bazel run //ling2/infer:generate -- --ckpt=DIR (--prompt=TEXT | --prompt_ids=1,2,3 | --prompts_file=FILE)
        --max_new_tokens=N [--temperature=0] [--top_k=0] [--top_p=1] [--seed=0] [--speculative_mtp] [--json]
        [key=value ...]

DIR: a trainer run or step directory, a Ling2 state directory or a Hugging Face directory
(`ling2.infer.load`). --prompt and --prompt_ids may repeat (one prompt each); --prompts_file
holds one prompt per line (UTF-8, a leading byte order mark skipped), text or a JSON object
{"prompt": TEXT} / {"ids": [...]}. The longest prompt plus --max_new_tokens may not exceed the
model's max_position_embeddings. Text goes through --tokenizer (default: the HF directory's
tokenizer.json, else the config's tokenizer_path). key=value pairs override the checkpoint's config (e.g. dtype=bfloat16).
--json prints {"ids": [[new tokens], ...]} on stdout (statistics on stderr). Bad input exits 2,
and so does --speculative_mtp on a HF directory without the MTP weights its config.json declares
(transformers does not save a Ling 3 model's), which otherwise loads without MTP.
"""

import codecs
import json
import sys

from absl import app, flags

from ling2.config import cli
from ling2.config.paths import user_path

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint directory: trainer run or step, Ling2 state, or Hugging Face.")
flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the checkpoint's, else the config's tokenizer_path).")
flags.DEFINE_multi_string("prompt", [], "A text prompt (repeat for a batch).")
flags.DEFINE_multi_string("prompt_ids", [], "A prompt as comma-separated token ids (repeat for a batch).")
flags.DEFINE_string("prompts_file", None, "One prompt per line: text, or JSON {\"prompt\": text} / {\"ids\": [...]}.")
flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per prompt.")
flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample from softmax(logits / temperature).")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set of tokens holding this probability (1: all).")
flags.DEFINE_integer("seed", 0, "Sampling seed (the same seed, flags and prompts give the same output).")
flags.DEFINE_bool("speculative_mtp", False, "Draft with the MTP layers, verify with one main forward per round.")
flags.DEFINE_bool("json", False, "Print {\"ids\": [[...], ...]} (the new tokens per prompt) on stdout.")
flags.DEFINE_bool("stop_at_eos", True, "Stop a prompt's generation after an end-of-sequence token (HF: config.json's "
                  "eos_token_id; Ling2: eod_id).")
flags.DEFINE_bool("packed_prefill", False, "Prefill the prompts packed into rows instead of left-padded.")

def parse_ids(text: str, where: str) -> list[int]:
    from ling2.infer.load import InferError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InferError(f"{where}: empty prompt (no token ids)")
    try:
        return [int(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not t.lstrip("-").isdigit())
        raise InferError(f"{where}: {bad!r} is not an integer token id") from None


def read_prompts() -> list:
    """Prompts in flag order: str (text) or list[int] (ids)."""
    from ling2.infer.load import InferError

    prompts = list(FLAGS.prompt)
    prompts += [parse_ids(t, f"--prompt_ids={t!r}") for t in FLAGS.prompt_ids]
    if FLAGS.prompts_file:
        path = user_path(FLAGS.prompts_file)
        if not path.is_file():
            raise InferError(f"--prompts_file={path}: no such file")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
            n = data.count(b"\n", 0, at) + 1
            raise InferError(f"{path}:{n}: not UTF-8 (byte 0x{data[at]:02x} at offset {at})") from None
        # Lines end at "\n" (and "\r\n") only: str.splitlines also ends them at form feeds, U+2028 and other
        # separators that are text inside a prompt, which would split it in two and misnumber the lines.
        for n, line in enumerate(text.split("\n"), start=1):
            line = line.removesuffix("\r")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InferError(f"{path}:{n}: malformed JSON: {e}") from None
                if "ids" in obj and isinstance(obj["ids"], list):
                    bad = [i for i in obj["ids"] if isinstance(i, bool) or not isinstance(i, int)]
                    if bad:
                        raise InferError(f"{path}:{n}: \"ids\" must be integers, got {bad[0]!r}")
                    prompts.append(obj["ids"])
                elif isinstance(obj.get("prompt"), str):
                    prompts.append(obj["prompt"])
                else:
                    raise InferError(f"{path}:{n}: a JSON line needs \"prompt\" (text) or \"ids\" (a list of ints)")
            else:
                prompts.append(line)
    if not prompts:
        raise InferError("no prompt: give --prompt, --prompt_ids or --prompts_file")
    return prompts


def check_length(ids: list, max_new_tokens: int, cfg) -> None:
    """InferError naming --max_new_tokens when the longest prompt plus the new tokens runs past the positions
    a model without RoPE scaling is configured for, the rule the trainer applies to its sequence length (with
    YaRN positions past max_position_embeddings are the scaling's business, as in training); a count past
    int32 is refused whatever the RoPE."""
    from ling2.infer.load import InferError

    longest = max(len(p) for p in ids)
    default = cfg.rope_type == "default"
    max_positions = cfg.max_position_embeddings if default else 2**31 - 1
    if longest + max_new_tokens > max_positions:
        what = f"the model's max_position_embeddings={max_positions}" if default else f"{max_positions} (int32)"
        raise InferError(f"--max_new_tokens={max_new_tokens}: the longest prompt ({longest} tokens) plus the new "
                         f"tokens ({longest + max_new_tokens}) exceed {what}; lower --max_new_tokens to at most "
                         f"{max(max_positions - longest, 0)}")


def load_tokenizer(loaded, needed: bool):
    """The tokenizers.Tokenizer to use, or None when none is configured and none is needed."""
    from ling2.infer.load import InferError, find_file

    if FLAGS.tokenizer:
        path = user_path(FLAGS.tokenizer)
    elif loaded.kind == "hf" and (loaded.path / "tokenizer.json").is_file():
        path = loaded.path / "tokenizer.json"
    elif loaded.cfg.tokenizer_path:
        path = find_file(loaded.cfg.tokenizer_path)
    else:
        if needed:
            raise InferError("text prompts need a tokenizer: pass --tokenizer=tokenizer.json (the checkpoint's config "
                             "has no tokenizer_path)")
        return None
    if not path.is_file():
        if needed:
            raise InferError(f"tokenizer {path}: no such file")
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        raise InferError(f"tokenizer {path}: unreadable ({e})") from None


def main(argv):
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # orbax warns of the step's item-level metadata file it does not need
    from ling2.infer.generation import Sampling, check_sampling
    from ling2.infer.load import InferError, load_model, print_out

    try:
        if not FLAGS.ckpt:
            raise InferError("--ckpt is required (a run, step, state or Hugging Face directory)")
        if FLAGS.max_new_tokens is None or FLAGS.max_new_tokens < 1:
            raise InferError(f"--max_new_tokens={FLAGS.max_new_tokens}: must be given and >= 1")
        prompts = read_prompts()
        check_sampling(Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p))
        loaded = load_model(user_path(FLAGS.ckpt), *argv[1:], need_mtp=FLAGS.speculative_mtp)
        tok = load_tokenizer(loaded, needed=any(isinstance(p, str) for p in prompts))
        ids = [tok.encode(p, add_special_tokens=False).ids if isinstance(p, str) else p for p in prompts]
        for i, p in enumerate(ids):
            if not p:
                raise InferError(f"prompt {i}: empty (a prompt needs at least one token)")
        check_length(ids, FLAGS.max_new_tokens, loaded.cfg)

        from ling2.infer.generation import generate

        out = generate(loaded.model, ids, FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                       top_p=FLAGS.top_p, seed=FLAGS.seed, stop_ids=loaded.stop_ids if FLAGS.stop_at_eos else (),
                       speculative=FLAGS.speculative_mtp, packed=FLAGS.packed_prefill)
        if FLAGS.json:
            print_out(json.dumps({"ids": out.ids}))
            print(json.dumps({"stats": out.stats}), file=sys.stderr)
            return 0
        lines = []
        for i, (p, new) in enumerate(zip(ids, out.ids)):
            if tok is not None:
                lines.append(f"[{i}] {tok.decode(p)}\033[1m{tok.decode(new)}\033[0m" if sys.stdout.isatty() else
                             f"[{i}] {tok.decode(p)} >>> {tok.decode(new)}")
            else:
                lines.append(f"[{i}] {p} >>> {new}")
        print_out("\n".join(lines))
    except InferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"stats: {json.dumps(out.stats)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)
