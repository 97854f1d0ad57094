"""The promised pieces are separate Bazel targets whose dependency edges follow how they were built:
config -> {MoE layers, data, GLA kernels} -> decoder -> MTP; checkpoint -> {convert, train}. Each piece's
`bazel query 'deps(...)'` is captured by a genquery (tests/BUILD) and read here."""

import os

import pytest


def deps(name: str) -> set:
    path = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "tests", f"deps_{name}")
    return {label for label in open(path).read().split() if label.startswith("//ling2")}


def packages(name: str) -> set:
    """The //ling2 targets `name` depends on, as 'pkg:target' without the leading //."""
    return {label[2:] for label in deps(name)}


def test_config_stands_alone():
    assert {p.split(":")[0] for p in packages("config")} == {"ling2/config"}


@pytest.mark.parametrize("op", ["gla", "kda", "moe", "attention"])
def test_kernels_depend_on_nothing_above_config(op):
    allowed = {f"ling2/kernels/{op}", "ling2/kernels", "ling2/config"}
    got = {p.split(":")[0] for p in packages(f"kernels_{op}")}
    assert f"ling2/kernels/{op}" in got
    assert got <= allowed, got - allowed
    others = {o for o in ("gla", "kda", "moe", "attention") if o != op}
    assert not any(p.startswith(f"ling2/kernels/{o}:") for p in packages(f"kernels_{op}") for o in others)


def test_data_depends_on_config_only():
    got = {p.split(":")[0] for p in packages("data")}
    assert got <= {"ling2/data", "ling2/config"}, got


def test_moe_layers_know_no_attention_or_decoder():
    got = packages("layers_moe")
    assert "ling2/layers/moe:moe" in got and "ling2/kernels/moe:moe" in got and "ling2/config:config" in got
    bad = {p for p in got if p.startswith("ling2/layers/attention") or p in
           {"ling2/layers:decoder", "ling2/layers:mtp", "ling2/layers:layers"} or p.startswith("ling2/kernels/gla")
           or p.startswith("ling2/kernels/kda")}
    assert not bad, bad


def test_attention_layers_know_no_moe():
    got = packages("layers_attention")
    assert "ling2/kernels/gla:gla" in got and "ling2/kernels/attention:attention" in got
    assert not any(p.startswith(("ling2/layers/moe", "ling2/kernels/moe")) for p in got), got


def test_decoder_builds_on_attention_and_moe_and_mtp_on_the_decoder():
    decoder = packages("decoder")
    assert {"ling2/layers/attention:attention", "ling2/layers/moe:moe", "ling2/config:config"} <= decoder
    assert "ling2/layers:mtp" not in decoder and "ling2/layers:layers" not in decoder
    mtp = packages("mtp")
    assert "ling2/layers:decoder" in mtp and "ling2/layers:layers" not in mtp
    assert {"ling2/layers:decoder", "ling2/layers:mtp"} <= packages("model")


def test_checkpoint_below_convert_and_train():
    checkpoint = {p.split(":")[0] for p in packages("checkpoint")}
    assert not checkpoint & {"ling2/convert", "ling2/train", "ling2/infer"}, checkpoint
    convert, train = packages("convert"), packages("train")
    assert "ling2/checkpoint:checkpoint" in convert and "ling2/checkpoint:checkpoint" in train
    assert not any(p.startswith("ling2/train") for p in convert)
    assert not any(p.startswith(("ling2/convert", "ling2/infer")) for p in train)
