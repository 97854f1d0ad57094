"""Ling2 checkpoint directory (converter output or trainer step) -> HF sharded safetensors.

  ./bazelw run //ling2/convert:ling2_to_hf -- --ckpt CKPT_DIR --out HF_DIR [--layout bailing|deepseek_v3]
      [--config CONFIG_YML] [--dtype bf16] [--shard_gb 2]

Writes model-0000i-of-0000n.safetensors, model.safetensors.index.json and config.json.
A trainer step directory ({run}/checkpoints/{step}) needs --config (the run's resolved config).
"""

import argparse
import sys

from ling2.convert.convert import convert_ling2_to_hf


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="Ling2 checkpoint directory (holds state/)")
    p.add_argument("--out", required=True, help="HF directory to write")
    p.add_argument("--layout", default="bailing", choices=("bailing", "deepseek_v3"))
    p.add_argument("--config", default=None, help="Ling2 config YAML (default: CKPT/config.yml)")
    p.add_argument("--dtype", default="", help="cast tensors to fp32, bf16 or fp16 (default: as stored)")
    p.add_argument("--shard_gb", type=float, default=2.0, help="maximum shard size in GB")
    p.add_argument("--no_progress", action="store_true")
    a = p.parse_args(argv)
    index = convert_ling2_to_hf(a.ckpt, a.out, layout=a.layout, config=a.config, dtype=a.dtype,
                                shard_bytes=int(a.shard_gb * (1 << 30)), progress=not a.no_progress)
    print(f"wrote {a.out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
