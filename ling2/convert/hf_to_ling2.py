"""HF safetensors (BailingMoeV2_5, Ling 3 bailing_hybrid or DeepSeek-V3 layout) -> Ling2 checkpoint directory.

  ./bazelw run //ling2/convert:hf_to_ling2 -- --hf_dir DIR --out CKPT_DIR [--scan_layers] [--dtype bf16]
      [--layout auto|bailing|bailing_hybrid|deepseek_v3] [--allow_missing_mtp] [--set key=value ...]

Writes CKPT_DIR/config.yml and CKPT_DIR/state/ (per-leaf safetensors; see ling2/convert/convert.py).
Bad input (a missing, malformed or mis-shaped file or field) is one `error:` line on stderr and exit 2.
"""

import argparse
import sys

from ling2.config import cli
from ling2.convert.convert import USER_ERRORS, convert_hf_to_ling2, report


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_dir", required=True, help="directory with config.json and (sharded) safetensors")
    p.add_argument("--out", required=True, help="Ling2 checkpoint directory to write")
    p.add_argument("--scan_layers", action="store_true", help="write the scanned (stacked) parameter layout")
    p.add_argument("--dtype", default="fp32", help="parameter dtype: fp32, bf16 or fp16")
    p.add_argument("--layout", default="auto", choices=("auto", "bailing", "bailing_hybrid", "deepseek_v3"))
    p.add_argument("--allow_missing_mtp", action="store_true", help="load a checkpoint without MTP tensors")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra Ling2 config overrides")
    p.add_argument("--no_progress", action="store_true")
    a = p.parse_args(argv)
    try:
        cfg = convert_hf_to_ling2(a.hf_dir, a.out, scan_layers=a.scan_layers, dtype=a.dtype, layout=a.layout,
                                  allow_missing_mtp=a.allow_missing_mtp, overrides=a.set, progress=not a.no_progress)
    except USER_ERRORS as e:
        return report(e)
    print(f"wrote {a.out}: {cfg.base_num_decoder_layers} layers + {cfg.mtp_num_layers} MTP, scan_layers={cfg.scan_layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
