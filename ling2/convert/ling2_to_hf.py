"""Ling2 checkpoint directory (converter output or trainer step) -> HF sharded safetensors.

  ./bazelw run //ling2/convert:ling2_to_hf -- --ckpt CKPT_DIR --out HF_DIR [--layout auto|bailing|bailing_hybrid|deepseek_v3]
      [--config CONFIG_YML] [--dtype bf16] [--shard_gb 2]

Writes model-0000i-of-0000n.safetensors, model.safetensors.index.json and config.json (with the
remote-code modules its auto_map names when the checkpoint came from hf_to_ling2 and kept them).
The config is the one saved with the checkpoint (a trainer step directory {run}/checkpoints/{step}
holds its run's) unless --config names another. Bad input is one `error:` line and exit 2.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from ling2.config import cli
from ling2.convert.convert import USER_ERRORS, auto_map_modules, convert_ling2_to_hf, report


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="Ling2 checkpoint directory (holds state/)")
    p.add_argument("--out", required=True, help="HF directory to write")
    p.add_argument("--layout", default="auto", choices=("auto", "bailing", "bailing_hybrid", "deepseek_v3"),
                   help="auto: bailing_hybrid (Ling 3) for KDA models, else bailing")
    p.add_argument("--config", default=None, help="Ling2 config YAML (default: the config saved with the checkpoint)")
    p.add_argument("--dtype", default="", help="cast tensors to fp32, bf16 or fp16 (default: as stored)")
    p.add_argument("--shard_gb", type=float, default=2.0, help="maximum shard size in GB")
    p.add_argument("--no_progress", action="store_true")
    a = p.parse_args(argv)
    if not (a.shard_gb > 0 and math.isfinite(a.shard_gb * (1 << 30))):
        p.error(f"--shard_gb must be a positive finite number of GB, got {a.shard_gb}")
    try:
        index = convert_ling2_to_hf(a.ckpt, a.out, layout=a.layout, config=a.config, dtype=a.dtype,
                                    shard_bytes=int(a.shard_gb * (1 << 30)), progress=not a.no_progress)
    except USER_ERRORS as e:
        return report(e)
    print(f"wrote {a.out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']} bytes")
    out = Path(a.out)
    missing = [m for m in auto_map_modules(json.loads((out / "config.json").read_text())) if not (out / m).is_file()]
    if missing:
        print(f"note: config.json's auto_map names {', '.join(missing)}: copy them from the model's Hugging Face "
              "repository (Ring-V2.5: models/) to load it with trust_remote_code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
