"""A strict check of a Kubernetes object against a CustomResourceDefinition's OpenAPI v3 schema.

As `kubectl apply --validate=strict` does, a field the schema does not name is an error (the API
server would otherwise drop it without a word). Checked: `type` (object, array, string, integer,
number, boolean; int32/int64 ranges), `properties`, `required`, `additionalProperties`, `items`,
`enum`, `nullable`, `x-kubernetes-int-or-string`, `x-kubernetes-preserve-unknown-fields`,
`pattern`, `minLength`/`maxLength`, `minimum`/`maximum`, `minItems`/`maxItems`, and unique keys of
`x-kubernetes-list-type: map` lists. Not checked: CEL rules (`x-kubernetes-validations`) and other
formats. A CRD's top-level `metadata` is a bare object (the API server checks ObjectMeta itself);
here it is checked against the common ObjectMeta fields below. Only PyYAML is needed.
"""

import re

import yaml

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 253}, "generateName": {"type": "string"},
    "namespace": {"type": "string", "maxLength": 63}, "labels": _STRING_MAP, "annotations": _STRING_MAP}}
_PY_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}
_INT_BOUNDS = {"int32": 2**31, "int64": 2**63}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def load_crd(path) -> dict:
    """A CRD file (YAML), parsed (with libyaml's loader when PyYAML has it: these files are large)."""
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def object_errors(obj: dict, crd: dict) -> list:
    """Every violation of `obj` (a whole object: apiVersion, kind, metadata, ...) against `crd`."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    if obj.get("kind") != kind:
        return [f"$.kind: {obj.get('kind')!r} is not {kind!r}"]
    versions = {f"{group}/{v['name']}": v for v in crd["spec"]["versions"]}
    if obj.get("apiVersion") not in versions:
        return [f"$.apiVersion: {obj.get('apiVersion')!r} is not one of {sorted(versions)}"]
    schema = versions[obj["apiVersion"]]["schema"]["openAPIV3Schema"]
    root = {**schema, "properties": {**schema["properties"], "metadata": OBJECT_META},
            "required": sorted({"apiVersion", "kind", "metadata", *schema.get("required", ())})}
    return errors(obj, root)


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if _NAME.fullmatch(key) else f"{path}[{key!r}]"


def _type_error(value, schema) -> str | None:
    if value is None:
        return None if schema.get("nullable") else "is null"
    kind, is_bool = schema.get("type"), isinstance(value, bool)
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not is_bool
    elif kind in ("integer", "number"):
        ok = isinstance(value, int if kind == "integer" else (int, float)) and not is_bool
    else:
        ok = kind is None or isinstance(value, _PY_TYPES[kind])
    want = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
    return None if ok else f"expected {want}, got {type(value).__name__} {value!r}"


def errors(value, schema: dict, path: str = "$") -> list:
    """Every violation of `value` against `schema`, each as 'JSON path: what is wrong'."""
    bad = _type_error(value, schema)
    if bad or value is None:
        return [f"{path}: {bad}"] if bad else []
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            out.append(f"{path}: length {len(value)} outside [{schema.get('minLength', 0)}, "
                       f"{schema.get('maxLength', 'inf')}]")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        bound = _INT_BOUNDS.get(schema.get("format"))
        if bound and not -bound <= value < bound:
            out.append(f"{path}: {value} out of {schema['format']} range")
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{path}: {value} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    elif isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items, outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        for i, item in enumerate(value):
            out += errors(item, schema.get("items", {}), f"{path}[{i}]")
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"])
                    for item in value if isinstance(item, dict)]
            out += [f"{path}: duplicate key {k}" for k in sorted(set(keys), key=str) if keys.count(k) > 1]
    elif isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        out += [f"{_child(path, k)}: required field missing" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], _child(path, k))
            elif isinstance(extra, dict):
                out += errors(v, extra, _child(path, k))
            elif not (extra is True or schema.get("x-kubernetes-preserve-unknown-fields")):
                out.append(f"{_child(path, k)}: unknown field")
    return out
