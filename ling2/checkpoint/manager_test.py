"""Checkpointer: an async save holds the state and data position of its step while later (donating)
steps run, its errors surface, and saves follow the period; checked against values kept by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.config import load_config, to_yaml
from ling2.checkpoint.manager import CONFIG_KEY, CheckpointError, Checkpointer, snapshot


class Counter:
    """A data iterator whose state is the number of batches taken (bytes, like the trainer's)."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return self.n

    def get_state(self):
        return str(self.n).encode()

    def set_state(self, state):
        self.n = int(state)

    def start_prefetch(self):
        pass


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
    assert meta == {"step": 2, CONFIG_KEY: to_yaml(cfg())} and it.n == want_n == 2  # the config rides with the step
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
