"""Checkpointer: an async save holds the state and data position of its step while later (donating)
steps run, its errors surface, and saves follow the period; checked against values kept by hand.
Integrity: a step appears only with its checksums; damaged or unfinished steps are found and skipped; the saved
config and the resume rules."""

import errno
import json
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.checkpoint import manager
from ling2.checkpoint.manager import (CheckpointError, Checkpointer, ResumeConfigError, check_resume_config,
                                      saved_config, snapshot)
from ling2.checkpoint.testing.iterators import Counter
from ling2.config import load_config
from ling2.config.schema import Config, resume_class


def cfg(**over):
    return load_config(model_name="ling2-tiny", **{"async_checkpointing": True, "checkpoint_period": 2,
                                                   "max_checkpoints_to_keep": 5, **over})


def state0():
    return {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5, jnp.bfloat16), "step": jnp.int32(0)}


step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)


def test_async_save_keeps_its_step_while_later_steps_donate(tmp_path):
    ck, it, s = Checkpointer(tmp_path, cfg()), Counter(), state0()
    for step in range(1, 4):
        next(it)
        s = step_fn(s)
        if step == 2:
            want, want_n = jax.tree.map(np.array, s), it.n
        ck.save(step, s, it, {"step": step})
    ck.close()
    assert ck.manager.all_steps() == [2]
    back, meta = Checkpointer(tmp_path, cfg()).restore(2, state0(), it)
    assert meta == {"step": 2} and it.n == want_n == 2
    for k in want:
        np.testing.assert_array_equal(np.asarray(back[k]), want[k])


@pytest.mark.parametrize("kind", [None, "pinned_host"])
def test_snapshot_copies_with_the_same_shardings(kind):
    s = state0()
    snap = snapshot({"s": s, "host": np.zeros(2)}, kind)
    for k, x in s.items():
        y = snap["s"][k]
        assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
        assert y.sharding.memory_kind == (kind or x.sharding.memory_kind)
        assert y.sharding.with_memory_kind(x.sharding.memory_kind) == x.sharding
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_saves_follow_the_period_and_never_repeat_a_step(tmp_path):
    ck, it, s = Checkpointer(tmp_path, cfg(checkpoint_period=3)), Counter(), state0()
    assert [ck.save(step, s, it, {}) for step in range(1, 8)] == [False, False, True, False, False, True, False]
    assert ck.save(7, s, it, {}, force=True) and not ck.save(7, s, it, {}, force=True)
    ck.close()
    assert ck.manager.all_steps() == [3, 6, 7]
    again = Checkpointer(tmp_path, cfg(checkpoint_period=3))
    assert not again.save(6, s, it, {}, force=True) and again.save(9, s, it, {})
    again.close()
    assert again.manager.all_steps() == [3, 6, 7, 9]


def test_background_failure_surfaces_at_the_next_save_and_at_close(tmp_path):
    class Broken(Counter):
        def get_state(self):
            return "not bytes"  # grain's handler calls .decode() on it in the background

    ck, s = Checkpointer(tmp_path, cfg()), state0()
    assert ck.save(2, s, Broken(), {})
    with pytest.raises(CheckpointError, match=r"/2: saving the checkpoint failed"):
        ck.save(4, s, Counter(), {})
    assert ck.save(6, s, Broken(), {})
    with pytest.raises(CheckpointError, match=r"/6: saving the checkpoint failed"):
        ck.close()
    assert ck.manager.all_steps() == []


def big_state():
    """A state whose array file is large enough to corrupt in its middle (random: compresses poorly)."""
    return {"w": jax.random.normal(jax.random.key(0), (200, 300)), "step": jnp.int32(7)}


def saved(tmp_path, steps=(2, 4), **over):
    ck, it = Checkpointer(tmp_path, cfg(async_checkpointing=False, **over)), Counter()
    for step in steps:
        ck.save(step, big_state(), it, {"step": step}, force=True)
    ck.close()
    return Checkpointer(tmp_path, cfg(**over))


def largest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_flipped_bytes_are_refused_and_resume_falls_back(tmp_path):
    """Bytes flipped in a saved array file: restoring that step raises, naming the file (it used to restore
    silently); resume warns, moves it aside and takes the step before, whose values are the saved ones."""
    ck = saved(tmp_path)
    victim = largest_file(tmp_path / "4" / "state")
    assert victim.stat().st_size > 100_000
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 8] = bytes(b ^ 0xFF for b in raw[len(raw) // 2:len(raw) // 2 + 8])
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"/4: checkpoint is unusable: .*{victim.name}: checksum mismatch"):
        ck.restore(4, big_state(), Counter())
    logs = []
    assert ck.resume_step(logs.append) == 2
    assert len(logs) == 1 and "checkpoint" in logs[0] and "checksum mismatch" in logs[0] and "step 2" in logs[0]
    assert ck.manager.all_steps() == [2] and (tmp_path / "4.rejected").is_dir()
    back, meta = ck.restore(2, big_state(), Counter())
    ck.close()
    assert meta == {"step": 2}
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(big_state()["w"]))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: shutil.rmtree(d / "meta"), "item 'meta' missing"),
    (lambda d: (d / "_CHECKPOINT_METADATA").unlink(), "missing file _CHECKPOINT_METADATA"),
    (lambda d: (d / "checksums.json").unlink(), "no checksums.json"),
    (lambda d: (d / "checksums.json").write_text("{"), "checksums.json unreadable"),
    (lambda d: (d / "checksums.json").write_text('{"files": null}'), r"checksums.json unreadable \('files' is a NoneType"),
    (lambda d: (d / "checksums.json").write_text('{"files": [1, 2]}'), r"checksums.json unreadable \('files' is a list"),
    (lambda d: (d / "checksums.json").write_text(json.dumps({"files": {**json.loads((d / "checksums.json").read_text())[
        "files"], "../x": [1, 2]}})), r"checksums.json names '../x', outside the step directory"),
    (lambda d: largest_file(d / "state").write_bytes(b"short"), "bytes, .* when saved"),
    (lambda d: (shutil.rmtree(d), shutil.copytree(d.parent / "2", d)),
     r"meta/metadata says step 2: the directory holds another step's checkpoint"),
    (lambda d: (shutil.move(d, d.parent / "4.moved"), d.symlink_to(d.parent / "2")),
     r"meta/metadata says step 2: the directory holds another step's checkpoint"),
    (lambda d: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in list(d.iterdir())], "empty directory"),
])
def test_incomplete_latest_step_falls_back_with_the_reason(tmp_path, damage, reason):
    ck = saved(tmp_path)
    damage(tmp_path / "4")
    logs = []
    assert ck.resume_step(logs.append) == 2
    assert re.search(reason, logs[0]), logs
    ck.close()


def test_a_step_appears_only_whole_with_its_checksums(tmp_path, monkeypatch):
    """The save runs its phases in SAVE_PHASES order and the step directory appears only when published, with a
    checksums.json that verifies (a kill at any phase leaves the whole step or none: save_kill_test). A save
    that fails before publishing leaves neither the step nor orbax's temporary directories."""
    seen = []

    def phase(name, step):
        d = tmp_path / str(step)
        seen.append((name, d.exists(), d.is_dir() and manager.verify(d, manager.ITEMS + ("data",)) is None))

    monkeypatch.setattr(manager, "_phase", phase)
    ck = Checkpointer(tmp_path, cfg(async_checkpointing=False))
    ck.save(2, big_state(), Counter(), {"step": 2}, force=True)
    published = manager.SAVE_PHASES.index("published")
    assert seen == [(name, i >= published, i >= published) for i, name in enumerate(manager.SAVE_PHASES)]

    def fail(name, step):
        if name == "checksummed":
            raise OSError("injected")

    monkeypatch.setattr(manager, "_phase", fail)
    with pytest.raises(CheckpointError, match=r"/4: saving the checkpoint failed: OSError: injected"):
        ck.save(4, big_state(), Counter(), {"step": 4}, force=True)
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
    assert Checkpointer(tmp_path, cfg()).resume_step(lambda s: None) == 2


def test_no_usable_checkpoint_is_an_error_listing_each(tmp_path):
    ck = saved(tmp_path)
    for s in (2, 4):
        (tmp_path / str(s) / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint(.|\n)*  4: no checksums.json(.|\n)*  2: no "):
        ck.resume_step(lambda s: None)
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4"]  # nothing moved: the user decides


def test_saved_config_and_resume_classes(tmp_path):
    """The run's config is saved with every step; resuming refuses model/data/batch changes with a diff and
    warns about optimizer-schedule changes (classes: ling2.config.schema.resume_class)."""
    ck = saved(tmp_path, steps=(2,))
    base = cfg(async_checkpointing=False)  # as `saved` saved it
    assert saved_config(tmp_path / "2") == base
    assert check_resume_config(base, base) == []
    free = base.model_copy(update={"attention_kernel": "dot_product", "checkpoint_period": 7, "log_period": 3})
    assert check_resume_config(base, free) == []
    warn = base.model_copy(update={"learning_rate": 1e-5, "steps": 5000, "warmup_steps_fraction": 0.5})
    got = check_resume_config(base, warn)
    assert len(got) == 3 and any("learning_rate changed: 0.0003 -> 1e-05" in line for line in got)
    bad = base.model_copy(update={"base_emb_dim": 96, "data_seed": 7, "learning_rate": 1e-5})
    with pytest.raises(ResumeConfigError) as e:
        check_resume_config(base, bad, 16, 32)
    msg = str(e.value)
    assert "base_emb_dim: 128 -> 96" in msg and "data_seed: 1234 -> 7" in msg and "learning_rate" not in msg
    assert "global batch (sequences per step): 16 -> 32" in msg
    assert ck.check_resume_config(2, bad.model_copy(update={"base_emb_dim": 128, "data_seed": 1234})) != []
    ck.close()
    for field in Config.model_fields:  # every field has a class
        assert resume_class(field) in ("fixed", "warn", "free")


def test_disk_full_during_a_save_is_one_named_error(tmp_path, capfd, monkeypatch):
    """A full disk while saving (a 200 KiB tmpfs where it can be mounted, else the checksum writer raising
    ENOSPC): one CheckpointError line that says so, and none of orbax's pages of traceback."""
    small = tmp_path / "small"
    small.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount(8)
        mounted = False
    if not mounted:
        def full(step_dir):
            raise OSError(errno.ENOSPC, "No space left on device", str(step_dir))

        monkeypatch.setattr(manager, "write_checksums", full)
    try:
        for async_save in (False, True):
            ck = Checkpointer(small / f"ck{int(async_save)}", cfg(async_checkpointing=async_save))
            with pytest.raises(CheckpointError) as e:
                ck.save(2, {"w": jax.random.normal(jax.random.key(1), (300, 300))}, Counter(), {}, force=True)
                ck.close()
            msg = str(e.value)
            assert "\n" not in msg and "disk full (no space left on device)" in msg and f"ck{int(async_save)}/2" in msg
            err = capfd.readouterr().err
            assert "Traceback" not in err and len(err.splitlines()) < 5, err
            if ck._pool is not None:
                ck._pool.shutdown()
    finally:
        if mounted:
            subprocess.run(["umount", str(small)])


@pytest.mark.parametrize("key, value", [("decoder_block", "ling2"), ("opt_type", "adamw"), ("dropout_rate", 0.0)])
def test_saved_config_with_a_removed_key_still_reads(tmp_path, key, value):
    """A saved config written before a key was removed (holding the key's one accepted value), a state
    directory's config.yml or a trainer step's config item, reads as the same config without it; the same key
    in a user's config is a named error (config_test)."""
    import json

    from ling2.checkpoint.manager import saved_config
    from ling2.checkpoint.state import read_config
    from ling2.config import to_yaml

    cfg = load_config(model_name="ling2-tiny")
    saved = tmp_path / "state_dir" / "config.yml"
    saved.parent.mkdir()
    saved.write_text(to_yaml(cfg) + f"{key}: {value!r}\n")
    assert read_config(saved) == saved_config(saved.parent) == cfg
    item = tmp_path / "step" / "config" / "metadata"
    item.parent.mkdir(parents=True)
    item.write_text(json.dumps({**cfg.model_dump(mode="json"), key: value}))
    assert saved_config(tmp_path / "step") == cfg


def test_a_bad_value_in_a_saved_config_names_that_file(tmp_path):
    """A state directory's config.yml with a value of the wrong type is an error that names the file as the
    value's source (not "override"), and an override given with it is still named as the override."""
    from ling2.checkpoint.state import CheckpointError, read_config
    from ling2.config import to_yaml

    saved = tmp_path / "config.yml"
    saved.write_text(to_yaml(load_config(model_name="ling2-tiny")).replace("base_emb_dim: 128", "base_emb_dim: abc"))
    with pytest.raises(CheckpointError, match=rf"base_emb_dim \(from {saved}\): .*'abc'"):
        read_config(saved)
    saved.write_text(to_yaml(load_config(model_name="ling2-tiny")))
    with pytest.raises(CheckpointError, match=r"base_mlp_dim \(from override\): .*'x'"):
        read_config(saved, "base_mlp_dim=x")
    assert read_config(saved, "base_mlp_dim=96").base_mlp_dim == 96
