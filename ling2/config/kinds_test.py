"""The config's table of attention kinds agrees with the schema (every named field exists) and decides what the
schema used to decide by name: validation, the layer cycle, the context-parallel granule and resuming (each
kind's kernel choices and chunking free, alike)."""

import pytest

from ling2.config import ConfigError, load_config
from ling2.config.kinds import FULL, KINDS
from ling2.config.schema import Config, resume_class


def test_kinds_match_the_layer_types_and_name_real_fields():
    assert {"mla", "gla", "kda"} <= set(KINDS)
    assert [k for k, v in KINDS.items() if v.role == "full"] == [FULL]
    for kind in KINDS.values():
        assert set(kind.fields) <= set(Config.model_fields) and set(kind.free_on_resume) <= set(kind.fields)
        assert kind.chunk_field is None or kind.chunk_field in kind.fields


@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v.role == "linear"])
def test_every_linear_kind_resumes_alike(kind):
    """A changed kernel backend or chunk size resumes silently for every linear kind (GLA and KDA both)."""
    entry = KINDS[kind]
    assert {resume_class(f) for f in entry.free_on_resume} == {"free"}
    assert {resume_class(f) for f in set(entry.fields) - set(entry.free_on_resume)} == {"fixed"}
    assert resume_class(entry.chunk_field) == "free"


def test_scan_and_loss_blocking_are_free_on_resume():
    assert resume_class("scan_layers") == resume_class("loss_vocab_blocks") == "free"


def test_layer_cycle_from_the_kind_table():
    """Ling2 (GLA): a trailing partial group is full attention; Ling 3 (KDA): it stays linear (hand-written)."""
    gla = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, inhomogeneous_layer_cycle_interval=2)
    assert gla.layer_types == ("gla", "mla", "gla", "mla", "mla")
    kda = load_config(model_name="ling3-tiny", base_num_decoder_layers=5, inhomogeneous_layer_cycle_interval=2)
    assert kda.layer_types == ("kda", "mla", "kda", "mla", "kda")


def test_context_granule_names_the_kind_chunk_field():
    cfg = load_config(model_name="ling3-tiny")
    problem = cfg.context_problem(3)
    assert problem is None or "kda_chunk_size" in problem
    cfg = load_config(model_name="ling2-tiny")
    problem = cfg.context_problem(3)
    assert problem is None or "gla_chunk_size" in problem


def test_unknown_linear_kind_is_named():
    with pytest.raises(ConfigError, match="linear_attention_type: unknown kind 'mamba'"):
        load_config(model_name="ling2-tiny", linear_attention_type="mamba")
