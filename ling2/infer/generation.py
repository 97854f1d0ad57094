"""Generation with a Ling2Model: prefill, cached decode, sampling and MTP self-speculative decoding.

  generate(model, prompt_ids, max_new_tokens, ...) -> Generation(ids, stats)

Layout. B prompts are left-padded into one [B, M + P] prefill (P the longest prompt rounded up
to PROMPT_BUCKET, M a margin of 2K slots for the speculative window), so every row's next token
goes to the same slot. Padding has segment id 0: the GLA kernel restarts its state where the
segment changes and attention only sees equal segments, so padding never reaches a row's
document (`ling2.layers.attention.decode`). Or prompts are packed into rows of documents with distinct
segment ids (`packed=True`), prefilled together, and each document's latents, GLA end state
and hidden states are moved into its own row of the same layout.

Prefill runs the chunked GLA kernel and the configured attention kernel; decode runs one GLA
recurrence step per token and MLA attention in the latent space (absorbed). Both are jitted
with fixed shapes: one prefill compile per (B, P), one decode loop (a `lax.while_loop`) per
cache size; nothing recompiles per token.

Speculative decoding (`speculative=True`, K = mtp_num_layers): with the next token x_m not yet
fed, MTP depth k drafts x_{m+k} from depth k-1's hidden state and the token k ahead; one main
forward over [x_m, drafts] (T = K + 1) verifies them, the longest agreeing prefix is kept plus
the main model's own next token (greedy: identical output to plain decoding; sampling: the
speculative-sampling accept/reject rule, the same distribution). Rows accept different counts:
each row's cache index moves by its own count, GLA layers keep the state after every verified
token to roll back to. Each depth caches its inputs over a window of the last 2K positions,
recomputed every round, so its cache holds teacher-forced inputs once the tokens are known.
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.infer.load import InferError
from ling2.layers.attention import decode as decode_lib
from ling2.layers.attention.registry import ATTENTION
from ling2.layers.moe.layer import MoE

PROMPT_BUCKET = 32
F32 = jnp.float32


class Sampling(NamedTuple):
    """temperature 0: greedy (argmax, first of ties). top_k 0 and top_p 1: no filtering."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


class Generation(NamedTuple):
    ids: list  # per prompt, the new tokens only (ending with a stop id when one was produced)
    stats: dict  # tokens, main forwards; with speculation the acceptance per depth


def check_sampling(s: Sampling, vocab: Optional[int] = None) -> None:
    """InferError naming the flag; vocab None (before a model is loaded) checks top_k's sign only."""
    if not (s.temperature >= 0 and np.isfinite(s.temperature)):
        raise InferError(f"--temperature={s.temperature}: must be a finite number >= 0")
    if vocab is None and s.top_k < 0:
        raise InferError(f"--top_k={s.top_k}: must be >= 0 (0: no top-k filter)")
    if vocab is not None and not 0 <= s.top_k <= vocab:
        raise InferError(f"--top_k={s.top_k}: must be in [0, vocab_size={vocab}] (0: no top-k filter)")
    if not 0 < s.top_p <= 1:
        raise InferError(f"--top_p={s.top_p}: must be in (0, 1]")


def check_prompts(prompt_ids, vocab: int) -> list[np.ndarray]:
    """The prompts as int32 arrays; InferError naming the prompt and the offending id."""
    prompts = [np.asarray(p) for p in prompt_ids]
    if not prompts:
        raise InferError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if p.ndim != 1 or p.size == 0:
            raise InferError(f"prompt {i}: empty (a prompt needs at least one token)")
        if not np.issubdtype(p.dtype, np.integer):
            raise InferError(f"prompt {i}: token ids must be integers, got {p.dtype}")
        bad = np.flatnonzero((p < 0) | (p >= vocab))
        if bad.size:
            raise InferError(f"prompt {i}: token id {int(p[bad[0]])} at offset {int(bad[0])} is outside the "
                             f"vocabulary [0, {vocab})")
        out.append(p.astype(np.int32))
    return out


def filter_logits(logits_BV, s: Sampling):
    """fp32 logits / temperature with everything outside top-k and the top-p nucleus at -inf."""
    x = logits_BV.astype(F32) / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        cut = jnp.min(jnp.where(before < s.top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cut, -jnp.inf, x)
    return x


def sample(logits_BV, key, s: Sampling):
    """[B] int32 tokens: argmax at temperature 0, else a draw from the filtered distribution."""
    if s.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BV, s), axis=-1).astype(jnp.int32)


def probs(logits_BV, s: Sampling):
    """The distribution `sample` draws from (one-hot at temperature 0)."""
    if s.temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), logits_BV.shape[-1], dtype=F32)
    return jax.nn.softmax(filter_logits(logits_BV, s), axis=-1)


def _slice_rows(x_BT_, start_B, size: int):
    """x[b, start[b]:start[b] + size] for every row."""
    return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size, 0))(x_BT_, start_B)


class Layout(NamedTuple):
    """The static shapes: row b's prompt fills slots [M + P - length_b, M + P), its next token goes
    to slot M + P. Prompt lengths are data, not part of the layout (no recompiles)."""

    B: int
    M: int  # margin slots (the speculative window) before every prompt
    P: int  # prompt slots (longest prompt, bucketed)
    S: int  # cache slots


def make_layout(prompts, max_new_tokens: int, K: int) -> Layout:
    P = -(-max(p.size for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    M = 2 * K
    return Layout(len(prompts), M, P, M + P + max_new_tokens + K)


def starts(prompts, lay: Layout) -> np.ndarray:
    """[B] first prompt slot of each row."""
    return lay.M + lay.P - np.asarray([p.size for p in prompts], np.int32)


def padded_inputs(prompts, lay: Layout):
    """Left-padded ids, positions and segment ids [B, M + P] (numpy)."""
    ids = np.zeros((lay.B, lay.M + lay.P), np.int32)
    seg = np.zeros_like(ids)
    start = starts(prompts, lay)
    for b, p in enumerate(prompts):
        ids[b, start[b]:] = p
        seg[b, start[b]:] = 1
    pos = np.maximum(np.arange(lay.M + lay.P)[None] - start[:, None], 0).astype(np.int32)
    return ids, pos, seg


def pack_rows(lengths, capacity: int) -> list[list[int]]:
    """Prompt indices per packed row, first fit in decreasing length (each row holds <= capacity tokens)."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


class Prefilled(NamedTuple):
    """What decoding starts from (all on device, the padded layout)."""

    cache: decode_lib.DecoderCache  # main decoder cache, index = M + P
    hidden: jax.Array  # [B, M + P, E] the main hidden state MTP consumes (pre- or post-norm per cfg)
    last_logits: jax.Array  # [B, V] at each row's last prompt token


def _mtp_hidden(model, out):
    return out.hidden_pre_norm if model.mtp is not None and model.mtp.pre_norm else out.hidden


def _prefill_padded(model, ids, pos, seg, S: int) -> Prefilled:
    cache = model.decoder.init_cache(ids.shape[0], S)
    out, cache = model.decoder.decode("prefill", ids, pos, cache, seg, return_logits=False)
    return Prefilled(cache, _mtp_hidden(model, out), model.decoder.logits(out.hidden[:, -1:])[:, 0])


def _prefill_packed(model, ids_RL, pos_RL, seg_RL, gather: decode_lib.Gather, S: int, num_docs: int) -> Prefilled:
    """Packed prefill of rows [R, L], then every document moved to its own row of the padded layout
    [B, M + P] (`gather`: where each padded slot and prompt takes its values from)."""
    R, L = ids_RL.shape
    out, packed = model.decoder.decode("prefill", ids_RL, pos_RL, model.decoder.init_cache(R, L), seg_RL,
                                       return_logits=False, opts=decode_lib.DecodeOptions(packed_docs=num_docs))
    cache = model.decoder.unpack(packed, gather, S)
    hidden = decode_lib.move_slots(_mtp_hidden(model, out), gather)
    return Prefilled(cache, hidden, model.decoder.logits(decode_lib.move_slots(out.hidden, gather)[:, -1:])[:, 0])


class Loop(NamedTuple):
    """The decode loop's carry."""

    cache: decode_lib.DecoderCache
    tokens: jax.Array  # [B, N + K + 1] generated tokens
    count: jax.Array  # [B] tokens generated
    last: jax.Array  # [B] the newest token, not yet fed to the model
    pos: jax.Array  # [B] its position
    done: jax.Array  # [B] bool
    step: jax.Array  # main forwards so far (prefill excluded)
    key: jax.Array
    # speculative only (empty or None otherwise)
    mtp: tuple = ()  # per depth: its decode cache (MTP.init_cache)
    hbuf: jax.Array = None  # [B, W, E] main hidden at positions pos-W .. pos-1
    tbuf: jax.Array = None  # [B, W + 1] tokens at positions pos-W .. pos
    attempts: jax.Array = None  # [K] drafts examined
    accepts: jax.Array = None  # [K] drafts accepted


def _is_stop(tok, stop_ids):
    if not stop_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32))


def _start(pre: Prefilled, lay: Layout, lengths, N: int, K: int, key, s: Sampling, stop_ids) -> Loop:
    key, k0 = jax.random.split(key)
    first = sample(pre.last_logits, k0, s)
    B = lay.B
    tokens = jnp.zeros((B, N + K + 1), jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, stop_ids) | (N <= 1)
    pos = jnp.asarray(lengths, jnp.int32)
    return Loop(pre.cache, tokens, jnp.ones((B,), jnp.int32), first, pos, done, jnp.zeros((), jnp.int32), key)


def _decode_loop(model, loop: Loop, N: int, s: Sampling, stop_ids, opts: decode_lib.DecodeOptions) -> Loop:
    def cond(c: Loop):
        return ~jnp.all(c.done)

    def body(c: Loop):
        out, cache = model.decoder.decode("step", c.last[:, None], c.pos[:, None], c.cache, opts=opts)
        key, k = jax.random.split(c.key)
        tok = sample(out.logits[:, 0], k, s)
        live = ~c.done
        cache = cache.replace(index=jnp.where(live, cache.index, c.cache.index))
        tokens = c.tokens.at[jnp.arange(tok.shape[0]), c.count].set(jnp.where(live, tok, 0))
        count = c.count + live
        done = c.done | (live & _is_stop(tok, stop_ids)) | (count >= N)
        return c._replace(cache=cache, tokens=tokens, count=count, last=jnp.where(live, tok, c.last),
                          pos=c.pos + live, done=done, step=c.step + 1, key=key)

    return jax.lax.while_loop(cond, body, loop)


# ---- MTP self-speculative decoding ----


def _mtp_prefill(model, pre: Prefilled, ids, pos, seg, first, S: int) -> tuple:
    """Every MTP depth's cache over the prompt slots: depth k at slot t sees the token k ahead
    (the first generated token after the prompt; 0 beyond) and depth k-1's hidden state."""
    B, T = ids.shape
    seq = jnp.concatenate([ids, first[:, None], jnp.zeros((B, len(model.mtp.depths)), jnp.int32)], axis=1)
    h, caches = pre.hidden, []
    for k in range(1, len(model.mtp.depths) + 1):
        h, _, cache = model.mtp.decode(k, "prefill", model.decoder, seq[:, k:k + T], h, pos, seg,
                                       model.mtp.init_cache(k, B, S), decode_lib.DecodeOptions())
        caches.append(cache)
    return tuple(caches)


def _head(model, y_normed_BTE):
    return model.decoder.logits(y_normed_BTE).astype(F32)


def _draft(model, c: Loop, W: int, s: Sampling, key, opts: decode_lib.DecodeOptions):
    """Every depth over the window of positions pos-W .. pos-1; returns (drafts [B,K], draft probs
    [B,K,V], new MTP caches)."""
    offs = jnp.arange(-W, 0, dtype=jnp.int32)
    pos = c.pos[:, None] + offs  # [B, W]
    seg = (pos >= 0).astype(jnp.int32)
    pos = jnp.maximum(pos, 0)
    base = c.cache.index - W  # slot of position pos - W
    h, ext, caches, drafts, qs = c.hbuf, c.tbuf, [], [], []
    keys = jax.random.split(key, len(model.mtp.depths))
    for k in range(1, len(model.mtp.depths) + 1):
        h, y_normed, cache = model.mtp.decode(k, "step", model.decoder, ext[:, k:k + W], h, pos, seg,
                                              c.mtp[k - 1].replace(index=base), opts)
        caches.append(cache)
        logits = _head(model, y_normed[:, -1:])[:, 0]
        d = sample(logits, keys[k - 1], s)
        drafts.append(d)
        qs.append(probs(logits, s))
        ext = jnp.concatenate([ext, d[:, None]], axis=1)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), tuple(caches)


def _accept(logits_BJV, drafts_BK, q_BKV, key, s: Sampling):
    """(accepted drafts a [B], the K + 1 tokens of which the first a + 1 are kept [B, K+1])."""
    B, K = drafts_BK.shape
    if s.temperature == 0:
        target = jnp.argmax(logits_BJV, axis=-1).astype(jnp.int32)  # [B, K+1]
        ok = drafts_BK == target[:, :K]
        return jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32), target
    p = probs(logits_BJV, s)  # [B, K+1, V]
    ku, kr = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :K], drafts_BK[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q_BKV, drafts_BK[..., None], -1)[..., 0]
    ok = jax.random.uniform(ku, (B, K)) * q_d < p_d  # accept with probability min(1, p/q)
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q_BKV, jnp.zeros_like(q_BKV[:, :1])], axis=1)  # nothing drafted after depth K
    resid = jnp.maximum(decode_lib.take_rows(p, a) - decode_lib.take_rows(q_pad, a), 0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, decode_lib.take_rows(p, a))
    fix = jax.random.categorical(kr, jnp.log(resid), axis=-1).astype(jnp.int32)
    tokens = jnp.concatenate([drafts_BK, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(K + 1)[None] == a[:, None], fix[:, None], tokens)
    return a, tokens


def _spec_loop(model, loop: Loop, N: int, K: int, s: Sampling, stop_ids, opts: decode_lib.DecodeOptions) -> Loop:
    W = 2 * K

    def cond(c: Loop):
        return ~jnp.all(c.done)

    def body(c: Loop):
        key, kd, ka = jax.random.split(c.key, 3)
        drafts, q, mtp = _draft(model, c, W, s, kd, opts)
        ids = jnp.concatenate([c.last[:, None], drafts], axis=1)  # positions pos .. pos + K
        pos = c.pos[:, None] + jnp.arange(K + 1, dtype=jnp.int32)
        out, cache = model.decoder.decode("step", ids, pos, c.cache, opts=opts._replace(history=True))
        a, new = _accept(out.logits.astype(F32), drafts, q, ka, s)  # new[:, j]: the token at pos + j + 1
        live = ~c.done
        B = a.shape[0]
        # tokens kept this round: new[:, :a+1], cut after a stop id and at N
        j = jnp.arange(K + 1)[None]
        stop = _is_stop(new, stop_ids) & (j <= a[:, None])
        first_stop = jnp.min(jnp.where(stop, j, K + 1), axis=1)
        n_new = jnp.minimum(jnp.minimum(a + 1, first_stop + 1), N - c.count) * live
        rows = jnp.arange(B)[:, None]
        cols = jnp.where(j < n_new[:, None], c.count[:, None] + j, c.tokens.shape[1] - 1)
        tokens = c.tokens.at[rows, cols].set(jnp.where(j < n_new[:, None], new, c.tokens[rows, cols]))
        count = c.count + n_new
        done = c.done | (live & (first_stop <= a)) | (count >= N)
        adv = jnp.where(live, a + 1, 0)
        cache = model.decoder.accept(c.cache, cache, a, live)
        hidden = _mtp_hidden(model, out)
        hbuf = _slice_rows(jnp.concatenate([c.hbuf, hidden.astype(c.hbuf.dtype)], axis=1), adv, W)
        tbuf = _slice_rows(jnp.concatenate([c.tbuf, new], axis=1), adv, W + 1)
        last = decode_lib.take_rows(new, a)
        reached = live[:, None] & (jnp.arange(K)[None] <= a[:, None])  # draft j+1 examined
        accepted = live[:, None] & (jnp.arange(K)[None] < a[:, None])
        return c._replace(cache=cache, tokens=tokens, count=count, last=jnp.where(live, last, c.last),
                          pos=c.pos + adv, done=done, step=c.step + 1, key=key, mtp=mtp, hbuf=hbuf, tbuf=tbuf,
                          attempts=c.attempts + jnp.sum(reached, 0), accepts=c.accepts + jnp.sum(accepted, 0))

    return jax.lax.while_loop(cond, body, loop)


def _spec_start(model, loop: Loop, pre: Prefilled, ids, pos, seg, lay: Layout, K: int) -> Loop:
    W = 2 * K
    T = lay.M + lay.P
    mtp = _mtp_prefill(model, pre, ids, pos, seg, loop.last, lay.S)
    hbuf = pre.hidden[:, T - W:]
    tbuf = jnp.concatenate([ids[:, T - W:], loop.last[:, None]], axis=1)
    z = jnp.zeros((K,), jnp.int32)
    return loop._replace(mtp=mtp, hbuf=hbuf, tbuf=tbuf, attempts=z, accepts=z)


class Generator:
    """Jitted prefill and decode loops of one model, reused across calls of equal shapes.

    `traces` counts how often each jitted function was traced (a test checks nothing retraces
    per token or per call of the same shapes)."""

    def __init__(self, model):
        for path, m in nnx.iter_graph(model):
            if isinstance(m, MoE) and not m.spec.sparse_matmul:
                raise InferError(f"MoE at {'/'.join(map(str, path))}: sparse_matmul=False is the capacity path, "
                                 "which drops tokens by batch; build the model with sparse_matmul=True "
                                 "(ling2.infer.load does)")
        self.graphdef, self.state = nnx.split(model)
        self.vocab = model.decoder.embed.embedding.shape[0]
        self.num_mtp = 0 if model.mtp is None else len(model.mtp.depths)
        self.traces = {"prefill": 0, "decode": 0}
        self.no_packed_prefill = sorted({layer.attn_type for _, layer in model.decoder.unstacked()
                                         if not ATTENTION[layer.attn_type].packed_prefill})
        self._run = jax.jit(self._generate, static_argnames=("lay", "N", "s", "stop_ids", "spec", "absorb", "packed"))

    def _generate(self, state, ids, pos, seg, lengths, key, packed_inputs, *, lay, N, s, stop_ids, spec, absorb,
                  packed):
        model = nnx.merge(self.graphdef, state)
        K = self.num_mtp if spec else 0
        self.traces["prefill"] += 1
        if packed is None:
            pre = _prefill_padded(model, ids, pos, seg, lay.S)
        else:
            p_ids, p_pos, p_seg, gather = packed_inputs
            pre = _prefill_packed(model, p_ids, p_pos, p_seg, decode_lib.Gather(**gather), lay.S, packed)
        loop = _start(pre, lay, lengths, N, K, key, s, stop_ids)
        self.traces["decode"] += 1
        opts = decode_lib.DecodeOptions(absorb=absorb)
        if not spec:
            return _decode_loop(model, loop, N, s, stop_ids, opts)
        loop = _spec_start(model, loop, pre, ids, pos, seg, lay, K)
        return _spec_loop(model, loop, N, K, s, stop_ids, opts)

    def generate(self, prompt_ids, max_new_tokens: int, *, sampling: Sampling = Sampling(), seed: int = 0,
                 stop_ids=(), speculative: bool = False, absorb: bool = True, packed: bool = False) -> Generation:
        prompts = check_prompts(prompt_ids, self.vocab)
        check_sampling(sampling, self.vocab)
        if max_new_tokens < 1:
            raise InferError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
        if not -2**63 <= seed < 2**63:  # what jax.random.PRNGKey takes
            raise InferError(f"--seed={seed}: must be a 64-bit signed integer")
        if speculative and not self.num_mtp:
            raise InferError("--speculative_mtp: the model has no MTP layers (mtp_num_layers=0)")
        if packed and self.no_packed_prefill:
            raise InferError(f"--packed_prefill: packed prefill is not supported for models with "
                             f"{', '.join(k.upper() for k in self.no_packed_prefill)} layers; "
                             "leave it off (each prompt is prefilled in its own row)")
        stop_ids = tuple(sorted({int(i) for i in stop_ids}))
        K = self.num_mtp if speculative else 0
        lay = make_layout(prompts, max_new_tokens, K)
        ids, pos, seg = padded_inputs(prompts, lay)
        packed_inputs, num_docs = None, None
        if packed:
            packed_inputs, num_docs = packed_layout(prompts, lay)
        lengths = np.asarray([p.size for p in prompts], np.int32)
        out = self._run(self.state, ids, pos, seg, lengths, jax.random.PRNGKey(seed), packed_inputs, lay=lay,
                        N=max_new_tokens, s=sampling, stop_ids=stop_ids, spec=speculative, absorb=absorb,
                        packed=num_docs)
        tokens, count = np.asarray(out.tokens), np.asarray(out.count)
        ids_out = [tokens[b, :count[b]].tolist() for b in range(lay.B)]
        stats = {"new_tokens": int(count.sum()), "main_forwards": int(out.step) + 1, "prompts": lay.B}
        if speculative:
            att, acc = np.asarray(out.attempts), np.asarray(out.accepts)
            stats["acceptance_per_depth"] = [float(a / max(t, 1)) for a, t in zip(acc, att)]
            stats["drafts_examined"], stats["drafts_accepted"] = att.tolist(), acc.tolist()
            stats["tokens_per_forward"] = float((count.sum() - lay.B) / max(int(att[0]), 1))
        return Generation(ids_out, stats)


def packed_layout(prompts, lay: Layout):
    """Packed rows [R, M + P] of whole prompts (distinct segment ids per document, positions from 0)
    and where each padded slot takes its values from (`_prefill_packed`). Returns (arrays, N docs per row)."""
    L = lay.M + lay.P
    lengths, start = [p.size for p in prompts], starts(prompts, lay)
    rows = pack_rows(lengths, L)
    R = len(rows)
    ids, pos, seg = (np.zeros((R, L), np.int32) for _ in range(3))
    row = np.full((lay.B, L), -1, np.int32)
    col = np.full((lay.B, L), -1, np.int32)
    doc = np.zeros((lay.B, 2), np.int32)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = int(lengths[i])
            ids[r, at:at + n], pos[r, at:at + n], seg[r, at:at + n] = prompts[i], np.arange(n), d + 1
            row[i, start[i]:], col[i, start[i]:] = r, np.arange(at, at + n)
            doc[i] = r, d
            at += n
    arrays = (ids, pos, seg, {"row": row, "col": col, "doc": doc})
    return arrays, max(len(m) for m in rows)


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_ids=(), speculative: bool = False, absorb: bool = True,
             packed: bool = False) -> Generation:
    """New tokens for each prompt (lists of ints) from a Ling2Model; see the module doc.

    Greedy at temperature 0; otherwise a draw, deterministic for a seed. Generation of a row stops
    after max_new_tokens or after a token in stop_ids (kept). speculative: MTP self-speculative
    decoding; absorb=False: MLA decode with expanded K/V (a reference); packed: packed prefill."""
    return Generator(model).generate(prompt_ids, max_new_tokens, sampling=Sampling(temperature, top_k, top_p),
                                     seed=seed, stop_ids=stop_ids, speculative=speculative, absorb=absorb,
                                     packed=packed)
