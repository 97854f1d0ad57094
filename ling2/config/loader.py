"""Loads a Config: base.yml -> models/{model_name}.yml -> key=value overrides.

Every error is a `ConfigError` whose message names the file and field at fault.
"""

import difflib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import pydantic
import yaml

from ling2.config.schema import GROUPS, REMOVED_KEYS, Config

CONFIGS_DIR = Path(os.path.abspath(__file__)).parents[2] / "configs"  # runfiles tree under Bazel
BASE_CONFIG = CONFIGS_DIR / "base.yml"


# libyaml's C loader and dumper when PyYAML has them (several times faster), else pure Python.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _UniqueKeys(_LOADER):
    """The safe loader, refusing a mapping that names a key twice (YAML would keep the last one silently)."""


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark,
                                                    f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str):
    """Parses YAML text with the fastest safe loader; a key given twice in one mapping is an error."""
    return yaml.load(text, Loader=_UniqueKeys)


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the file and field."""


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = load_yaml(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: malformed YAML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of key: value, got {type(data).__name__}")
    return data


def _unknown(key: str, where: str) -> ConfigError:
    if key in REMOVED_KEYS:
        return ConfigError(f"{where}: config key {key!r} was removed: {REMOVED_KEYS[key]}; delete it")
    close = difflib.get_close_matches(key, Config.model_fields, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"{where}: unknown config key {key!r}{hint}")


def without_removed(saved: Mapping[str, Any]) -> dict:
    """A saved resolved config (a checkpoint's config.yml) without the keys Ling2 no longer reads."""
    return {k: v for k, v in saved.items() if k not in REMOVED_KEYS}


def _merge(into: dict, layer: Mapping[str, Any], where: str, sources: dict) -> None:
    for k, v in layer.items():
        if not isinstance(k, str):  # YAML reads `1:`, `true:`, `~:` as a number, bool or null
            raise ConfigError(f"{where}: config key {k!r} ({type(k).__name__}) is not a field name")
        if k not in Config.model_fields:
            raise _unknown(k, where)
        into[k] = v
        sources[k] = where


def parse_overrides(items: Sequence[str]) -> dict:
    """`["a=1", "b=[x, y]"]` -> {"a": 1, "b": ["x", "y"]}; values are parsed as YAML scalars."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"command line: expected key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key] = raw
    return out


def _chain(path: Path, seen: tuple = ()) -> list[tuple[Path, dict]]:
    """A config file and the `base_config` files it extends, base first."""
    if path in seen:
        loop = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError(f"{seen[-1]}: base_config loop: {loop}")
    data = _read_yaml(path)
    parent = data.pop("base_config", None)
    if parent is None:
        return [(path, data)]
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: base_config must be a file path, got {parent!r}")
    return _chain(Path(os.path.abspath(path.parent / parent)), seen + (path,)) + [(path, data)]


def _root_hint(chain) -> str:
    """Why a chain rooted elsewhere than a base.yml lacks fields: the usual slip is a missing `base_config`."""
    root = chain[0][0]
    if root.name == BASE_CONFIG.name:
        return ""
    return f"; {root} is the root of its config chain: a run's config names its parent with `base_config: <path>`" \
           f" (e.g. {BASE_CONFIG})"


def load_config(*overrides: Union[str, Mapping[str, Any]], config_file: Union[str, os.PathLike, None] = None,
                named: Sequence[tuple[str, Mapping[str, Any]]] = (), **kwargs: Any) -> Config:
    """Resolve a Config.

    Args:
      *overrides: "key=value" strings and/or mappings, applied last, in order.
      config_file: the root config (default configs/base.yml). It may name a parent with
        `base_config: <path relative to it>`. Model files are read from `models/` next to
        the first file of that chain.

    Precedence, lowest first: the chain's first file (base.yml), the model file of `model_name`, the
    chain's other files (a run's own config, e.g. configs/train/ling2-128k.yml stretching the model's
    RoPE), then the overrides.
      named: (source, mapping) pairs applied after the files and before the overrides, errors naming
        `source` (e.g. a state directory's config.yml) instead of "override".
      **kwargs: more overrides.
    """
    root = Path(config_file) if config_file else BASE_CONFIG
    chain = _chain(Path(os.path.abspath(root)))  # lexical: keeps Bazel runfiles paths

    cli: dict = {}
    for o in overrides:
        cli.update(parse_overrides([o]) if isinstance(o, str) else dict(o))
    cli.update(kwargs)
    for k in cli:
        if k not in Config.model_fields:
            raise _unknown(k, "override")

    model_name = "default"
    for _, data in list(chain) + list(named):
        model_name = data.get("model_name", model_name)
    model_name = cli.get("model_name", model_name)
    layers = [(str(path), data) for path, data in chain[:1]]
    if model_name != "default":
        model_file = chain[0][0].parent / "models" / f"{model_name}.yml"
        if not model_file.is_file():
            known = sorted(p.stem for p in model_file.parent.glob("*.yml"))
            raise ConfigError(f"{model_file}: model file for model_name={model_name!r} not found (known: {known})"
                              + _root_hint(chain))
        layers.append((str(model_file), _read_yaml(model_file)))
    layers += [(str(path), data) for path, data in chain[1:]] + [(str(w), dict(d)) for w, d in named] + [("override", cli)]
    merged: dict = {}
    sources: dict = {}
    for where, data in layers:
        _merge(merged, data, where, sources)

    missing = [k for k in Config.model_fields if k not in merged]
    if missing:
        shown = f"{missing[:8]} and {len(missing) - 8} more" if len(missing) > 8 else f"{missing}"
        raise ConfigError(f"{chain[0][0]}: missing config keys {shown} (base.yml must define every field)"
                          + _root_hint(chain))
    try:
        return Config(**merged)
    except pydantic.ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            if err["loc"]:
                src = sources.get(err["loc"][0], "?")
                lines.append(f"{field} (from {src}): {msg} [got {err.get('input')!r}]")
            else:
                lines.append(f"{msg} (model_name={model_name})")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, one commented section per concern."""
    data = cfg.model_dump(mode="json")
    parts = []
    for group in GROUPS:
        parts.append(f"# --- {group.__name__} ---\n")
        for k in group.model_fields:
            flow = None if isinstance(data[k], list) else False
            parts.append(yaml.dump({k: data[k]}, Dumper=_DUMPER, default_flow_style=flow, width=1 << 30))
    return "".join(parts)
