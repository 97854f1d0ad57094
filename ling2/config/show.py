"""Prints the resolved config as YAML: `bazel run //ling2/config:show -- model_name=ling2 num_experts=64`.

`--config=PATH` picks the root config file. A bad config exits 2 with the message.
"""

import sys

from ling2.config import ConfigError, load_config, to_yaml
from ling2.config.paths import user_path


def main(argv: list[str]) -> int:
    config_file = None
    overrides = []
    for a in argv:
        if a.startswith("--config="):
            config_file = str(user_path(a.split("=", 1)[1]))
        else:
            overrides.append(a)
    try:
        cfg = load_config(*overrides, config_file=config_file)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(cfg))
    print("# derived")
    print(f"# layer_types: {list(cfg.layer_types)}")
    print(f"# mlp_types: {list(cfg.mlp_types)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
