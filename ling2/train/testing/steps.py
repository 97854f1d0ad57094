"""One training step on a mesh of fake CPU devices, compared tensor by tensor: the helpers of the tests that show a
sharded layout (context parallelism, pipeline stages) computes what one device does."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.train import runtime
from ling2.train import step as S
from ling2.train.state import abstract_state, init_state

CUTS = ([5, 37, 64, 70], [16, 100])  # per row (cycled): doc starts; 64 is every split's edge, 16 and 32 some


def packed_batch(cfg, M, B, seed=0):
    """[M, B, T] arrays of packed documents (T = cfg.max_target_length, at least 101): segment ids count
    documents, positions restart in each."""
    T = cfg.max_target_length
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (M, B, T + 1)).astype(np.int32)
    seg = np.ones((M, B, T), np.int32)
    pos = np.zeros((M, B, T), np.int32)
    for m in range(M):
        for b in range(B):
            cuts = CUTS[(b + m) % len(CUTS)]
            starts = np.zeros(T, np.int32)
            starts[cuts] = 1
            seg[m, b] = 1 + np.cumsum(starts)
            start = np.maximum.accumulate(np.where(starts == 1, np.arange(T), 0))
            pos[m, b] = np.arange(T) - start
    w = np.ones((M, B, T), np.float32)
    w[:, :, -1] = 0
    w[:, :, 63] = 0
    return dict(inputs=ids[..., :-1], targets=ids[..., 1:], positions=pos, segment_ids=seg, loss_weights=w)


def run_step(cfg, devices, batch, params_fn=None):
    """(loss, the first micro-batch's gradients, the state after one step: parameters and the loss-free expert
    biases, moved by the step's expert counts) as numpy, on a mesh over `devices`; `params_fn` maps the
    initial parameters first."""
    mesh = runtime.make_mesh(cfg, devices)
    setup = abstract_state(cfg, mesh)
    state = init_state(cfg, mesh, setup)
    if params_fn is not None:
        state = dataclasses.replace(state, params=params_fn(state.params))
    M, B, T = batch["inputs"].shape
    sh = runtime.batch_sharding(cfg, mesh, B, T)
    batch = {k: jax.device_put(v, sh) for k, v in batch.items()}
    tokens = {"tokens": jnp.sum(batch["loss_weights"])}
    if cfg.mtp_num_layers:
        counts = jax.vmap(lambda w, s: S.depth_token_counts(w, s, cfg.mtp_num_layers))(batch["loss_weights"],
                                                                                      batch["segment_ids"])
        tokens["mtp_tokens"] = jnp.sum(counts, axis=0)
    grad_fn = jax.jit(jax.grad(functools.partial(S.forward, setup.graphdef, cfg=cfg, step_tokens=tokens), has_aux=True))
    step_fn = S.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
    with jax.set_mesh(mesh):
        grads, _ = grad_fn(state.params, state.rest, jax.tree.map(lambda x: x[0], batch))
        new, metrics = step_fn(state, batch)
    flat = lambda tree: {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(tree)}  # noqa: E731
    return float(metrics["loss"]), flat(grads), {**flat(new.params), **flat(new.rest)}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
