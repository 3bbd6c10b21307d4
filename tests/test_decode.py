"""Compiled decoding (`rollout.compile_decode`, mlx_grpo.decode) against mlx_lm's
op-by-op batch generator (`rollout._decode` without it): the same tokens for the same
keys, the same caches for the next turn, the samplers' keys left where the other path
leaves them, and a bounded number of compiled shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_f32_close, tiny_additions
from mlx.utils import tree_map

from mlx_grpo.cli import cmd_train
from mlx_grpo.config import LoRAConfig, RolloutConfig
from mlx_grpo.decode import CompiledDecoder, capacity
from mlx_grpo.models import apply_lora
from mlx_grpo.rollout import _decode, decode_traces, keyed_samplers, prefill_prompts

TOY_ENV = Path(__file__).parent / "data" / "toy_env"


def _turns(model, tok, cfg, prompts, observations, compiled: bool, seed: int):
    """Three turns of every prompt: the first on its prompt, then each observation of
    its row fed on the cache that the previous turn handed back."""
    cfg = cfg.model_copy(update={"compile_decode": compiled})
    samplers = keyed_samplers(cfg, mx.random.split(mx.random.key(seed), len(prompts)))
    caches = prefill_prompts(model, prompts)
    tails, turns = [[p[-1]] for p in prompts], []
    for obs in observations:
        tails = tails if obs is None else obs
        out = _decode(model, tok, tails, caches, cfg, samplers)
        turns.append([(ids, finish) for ids, finish, _, _ in out])
        caches = [c for _, _, c, _ in out]
    return turns, [np.array(s.key).tolist() for s in samplers], caches


@pytest.mark.parametrize(
    "settings,overhead",
    [
        (dict(temperature=1.5), None),
        (dict(temperature=2.0, top_k=120, top_p=0.95), None),
        (dict(temperature=1.5), 0),
    ],
)
def test_compiled_decode_samples_what_mlx_lm_samples(tiny, settings, overhead, monkeypatch):
    """Rows of different prompt and observation lengths, some stopping at a stop token
    and some at the length limit, over three turns: the same ids and finish reasons,
    the same keys afterwards, and per-row caches that hold the same keys and values (the
    attention runs over a longer, masked row: float32 rounding of its sums at most).
    Rows stop at different steps, so the batch shrinks as they end (more shapes). With
    no cost to a prefill pass (`overhead` 0), each length of observation is prefilled in
    a bucket of its own, each padded to its own longest, at its own column."""
    import mlx_grpo.decode as decode_mod

    buckets = []
    if overhead is not None:
        monkeypatch.setattr(decode_mod, "PREFILL_BUCKET_OVERHEAD", overhead)

        def counted(lengths, cost, split=decode_mod.length_buckets):
            buckets.append(len(split(lengths, cost)))
            return split(lengths, cost)

        monkeypatch.setattr(decode_mod, "length_buckets", counted)
    model, tok = tiny
    # A tenth of the vocabulary stops a reply, as EOS does (the tiny model rarely
    # samples EOS), so that rows end at different steps.
    stops = set(tok.eos_token_ids) | set(range(0, len(tok.vocab), 10))
    monkeypatch.setattr(tok, "eos_token_ids", stops)
    cfg = RolloutConfig(max_new_tokens=24, **settings)
    words = ["a", "short prompt", "another, much longer prompt here", "mid length", "x y z"]
    prompts = [tok.encode(f"{w} number {i}") for i, w in enumerate(words * 2)]
    observations = [
        None,
        *[[tok.encode(" " + w * (t + 1)) for w in words[::-1] * 2] for t in (0, 1)],
    ]
    want, want_keys, want_caches = _turns(model, tok, cfg, prompts, observations, False, 5)
    got, got_keys, got_caches = _turns(model, tok, cfg, prompts, observations, True, 5)
    assert got == want
    assert got_keys == want_keys
    finishes = {f for turn in want for _, f in turn}
    assert finishes == {"stop", "length"}  # both ends are exercised
    assert decode_traces(model) > 1  # the batch shrank
    if overhead is not None:
        assert buckets and min(buckets) > 2  # the rows' tails in several buckets
    widest = capacity(max(c[0].offset for c in want_caches) + cfg.max_new_tokens + 1)
    for a, b in zip(want_caches, got_caches):
        for x, y in zip(a, b):
            assert y.offset == x.offset
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                u, v = np.array(u[..., : x.offset, :]), np.array(v[..., : y.offset, :])
                # A key is one projection of a hidden state that went through two
                # layers of sums of at most 64 terms and one attention row of at most
                # the widest turn's capacity.
                bound = 4 * (64 * 2 + widest) * np.finfo(np.float32).eps
                assert np.abs(u - v).max() <= bound * max(np.abs(u).max(), 1.0)


def test_rows_whose_tails_share_one_prefill_bucket_each_decode_as_alone(
    tiny, tiny_model_dir, monkeypatch
):
    """Observations of close lengths, fed shortest first: their tails are prefilled in
    one bucket, which lists the rows longest first. Each row then samples what it
    samples alone in a batch of one (a batch whose layout nothing else shapes), and
    what the op-by-op path samples; its cache holds its own tail's keys."""
    import mlx_grpo.decode as decode_mod

    buckets = []

    def recorded(lengths, cost, split=decode_mod.length_buckets):
        buckets.append(split(lengths, cost))
        return buckets[-1]

    monkeypatch.setattr(decode_mod, "length_buckets", recorded)
    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.5, compile_decode=True)
    prompts = [tok.encode(f"prompt {'w' * i} number {i}") for i in range(6)]
    observations = [tok.encode(" " + "ab" * (i + 1)) for i in range(6)]
    keys = mx.random.split(mx.random.key(11), len(prompts))

    def second_turn(rows, compiled):
        c = cfg.model_copy(update={"compile_decode": compiled})
        samplers = keyed_samplers(c, keys[mx.array(rows)])
        caches = prefill_prompts(model, [prompts[i] for i in rows])
        first = _decode(model, tok, [[prompts[i][-1]] for i in rows], caches, c, samplers)
        caches = [cache for _, _, cache, _ in first]
        return _decode(model, tok, [observations[i] for i in rows], caches, c, samplers)

    batch = second_turn(list(range(6)), True)
    assert buckets[-1] == [[5, 4, 3, 2, 1, 0]]  # one bucket, not in the batch's order
    plain = second_turn(list(range(6)), False)
    assert [(ids, f) for ids, f, _, _ in batch] == [(ids, f) for ids, f, _, _ in plain]
    # Alone, a row's attention runs over another width, with its columns elsewhere: its
    # sums in another order (the layers' reductions and one attention row of at most
    # the batch's capacity; the entropy then sums over the vocabulary).
    config = json.loads((tiny_model_dir / "config.json").read_text())
    widest = capacity(max(c[0].offset for _, _, c, _ in batch) + cfg.max_new_tokens + 1)
    bound = 4 * (64 * 2 + widest) * np.finfo(np.float32).eps
    for i in range(6):
        ((ids, finish, cache, entropies),) = second_turn([i], True)
        assert (ids, finish) == batch[i][:2]
        assert_f32_close(entropies, batch[i][3], tiny_additions(config) + widest, "entropies")
        for x, y in zip(cache, batch[i][2]):
            assert x.offset == y.offset
            u, v = np.array(x.keys[..., : x.offset, :]), np.array(y.keys[..., : y.offset, :])
            assert np.abs(u - v).max() <= bound * max(np.abs(u).max(), 1.0)


@pytest.mark.parametrize("compiled", [False, True])
def test_each_sampled_id_carries_the_entropy_of_the_distribution_it_came_from(
    tiny, tiny_model_dir, compiled, monkeypatch
):
    """Three turns of rows of different lengths, some ending at a stop id: each path
    returns, per sampled id, the entropy of the untempered policy at that position. The
    reference is a full forward pass over the row's whole sequence (prompt, replies and
    observations), with -sum p log p of its log-softmax taken in float64: no cache, no
    sampler, no temperature (the rollout samples at 1.5)."""
    model, tok = tiny
    stops = set(tok.eos_token_ids) | set(range(0, len(tok.vocab), 10))
    monkeypatch.setattr(tok, "eos_token_ids", stops)
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.5, compile_decode=compiled)
    words = ["a", "short prompt", "another, much longer prompt here", "x y z"]
    prompts = [tok.encode(f"{w} number {i}") for i, w in enumerate(words)]
    observations = [[tok.encode(" " + w * (t + 1)) for w in words[::-1]] for t in (0, 1)]
    samplers = keyed_samplers(cfg, mx.random.split(mx.random.key(3), len(prompts)))
    caches = prefill_prompts(model, prompts)
    seqs = [list(p) for p in prompts]
    got, want = [], []
    tails = [[p[-1]] for p in prompts]
    for turn in range(3):
        out = _decode(model, tok, tails, caches, cfg, samplers)
        for i, (ids, _, _, entropies) in enumerate(out):
            assert len(entropies) == len(ids)
            got += entropies
            starts = len(seqs[i]) - 1  # the position that predicts the first id
            seqs[i] += ids
            logits = np.array(model(mx.array(seqs[i])[None])[0].astype(mx.float32), np.float64)
            lp = logits - logits.max(-1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
            want += list(-(np.exp(lp) * lp).sum(-1)[starts : starts + len(ids)])
        if turn < 2:
            tails = observations[turn]
            for i, obs in enumerate(tails):
                seqs[i] += obs
            caches = [c for _, _, c, _ in out]
    assert len(got) > 3 * len(prompts)  # rows sampled more than one id a turn
    if compiled:  # rows left the batch as they ended (their entropies with them)
        assert decode_traces(model) > 1
    # A position's logits went through the layers' reductions and its attention row
    # (at most the longest sequence; the compiled path attends over its capacity) in
    # another order; the entropy then sums over the vocabulary.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    longest = max(map(len, seqs))
    n = tiny_additions(config) + longest + (capacity(longest + 13) if compiled else 0)
    assert_f32_close(got, want, n, "entropies")


def test_both_paths_stop_after_a_line_break_under_stop_at_newline(tiny, monkeypatch):
    """With `stop_at_newline`, a row ends right after its first line-break id on either
    path (here a twentieth of the vocabulary stands for the line breaks: the tiny model
    rarely samples one), and the two paths sample the same ids; without it, rows run on
    past those ids. At temperature 1.5 the tiny model's draws are near uniform, so a
    row of 24 ids meets no break about a third of the time (0.95^24 = 0.29 if uniform;
    4-8 of 16 rows for keys 0-5): among 16 rows both ends occur whatever the draws."""
    from mlx_grpo import rollout

    model, tok = tiny
    breaks = frozenset(range(3, len(tok.vocab), 20)) - set(tok.eos_token_ids)
    monkeypatch.setattr(rollout, "newline_ids", lambda tokenizer: breaks)
    cfg = RolloutConfig(max_new_tokens=24, temperature=1.5, stop_at_newline=True)
    prompts = [tok.encode(f"prompt {w} number {i}") for i, w in enumerate("abcdefghijklmnop")]
    want, _, _ = _turns(model, tok, cfg, prompts, [None], False, 7)
    got, _, _ = _turns(model, tok, cfg, prompts, [None], True, 7)
    assert got == want
    for ids, finish in want[0]:
        assert not breaks & set(ids[:-1])
        assert (finish == "stop") == (ids[-1] in breaks | set(tok.eos_token_ids))
    assert {f for _, f in want[0]} == {"stop", "length"}
    cfg = cfg.model_copy(update={"stop_at_newline": False})
    free, _, _ = _turns(model, tok, cfg, prompts, [None], False, 7)
    assert any(breaks & set(ids[:-1]) for ids, _ in free[0])


def test_turns_of_varied_lengths_share_a_compiled_shape(tiny, monkeypatch):
    """Twenty turns of different prompt and tail lengths at one batch size compile one
    graph per cache width they take, and they take few (four an octave of context);
    a batch of another size compiles one more."""
    import mlx_grpo.decode as decode_mod

    needs, size = [], decode_mod.capacity  # the columns each turn needs

    def recorded(columns):
        needs.append(columns)
        return size(columns)

    monkeypatch.setattr(decode_mod, "capacity", recorded)
    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=8, compile_decode=True)
    decoder = CompiledDecoder(model)
    for n in range(10):
        prompts = [tok.encode("p" * (5 + 3 * n + i)) for i in range(4)]
        samplers = keyed_samplers(cfg, mx.random.split(mx.random.key(n), 4))
        caches = prefill_prompts(model, prompts)
        out = decoder([[p[-1]] for p in prompts], caches, 8, set(tok.eos_token_ids), samplers)
        tails = [tok.encode("o" * (1 + n + 2 * i)) for i in range(4)]
        decoder(tails, [c for _, _, c, _ in out], 8, set(tok.eos_token_ids), samplers)
    widths = {size(c) for c in needs}
    assert len(set(needs)) > 2 * len(widths)  # many lengths, few widths
    assert len(widths) <= 4 * math.log2(max(needs) / min(needs)) + 1
    assert decoder.traces == len(widths)
    samplers = keyed_samplers(cfg, mx.random.split(mx.random.key(0), 3))
    caches = prefill_prompts(model, prompts[:3])
    decoder([[p[-1]] for p in prompts[:3]], caches, 8, set(tok.eos_token_ids), samplers)
    assert decoder.traces == len(widths) + 1


def test_the_compiled_step_reads_the_adapters_current_weights(tiny):
    """Sampling through live LoRA layers (`rollout.fold_adapters=false`): after an update
    changes lora_b, a step compiled before it (same shapes, no new trace) samples from
    the new weights, as the op-by-op path does."""
    model, tok = tiny
    apply_lora(model, LoRAConfig(rank=4, scale=20.0))
    cfg = RolloutConfig(max_new_tokens=16, temperature=1.0)
    prompts = [tok.encode(f"prompt number {i}") for i in range(4)]
    observations = [None]

    def set_lora_b(seed):
        mx.random.seed(seed)
        for layer in model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
                proj.lora_b = 0.05 * mx.random.normal(proj.lora_b.shape)
        mx.eval(model.parameters())

    runs = []
    for seed in (1, 2):
        set_lora_b(seed)
        want, _, _ = _turns(model, tok, cfg, prompts, observations, False, 3)
        got, _, _ = _turns(model, tok, cfg, prompts, observations, True, 3)
        assert got == want
        runs.append((want, decode_traces(model)))
    assert runs[0][0] != runs[1][0]  # the new weights sample other tokens
    assert runs[0][1] == runs[1][1]  # from the graph traced before the update


@pytest.mark.parametrize("lora", [False, True])  # the lean step; the model call
def test_a_model_s_compiled_decoder_lives_as_long_as_the_model(lora):
    """`rollout.compiled_decoder` builds one decoder a model and hands it back on later
    turns, which reuse its traces; `decode_traces` is None for a model that has not
    decoded compiled. Neither the decoder nor its compiled steps keep the model alive:
    once the model is freed, so is its decoder."""
    import gc
    import weakref
    from types import SimpleNamespace

    from mlx_grpo import rollout

    model = _family_model("llama")
    if lora:
        apply_lora(model, LoRAConfig(rank=4))
    other = _family_model("llama")
    cfg = RolloutConfig(max_new_tokens=4, temperature=1.0)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]

    def turn(model):
        samplers = keyed_samplers(cfg, mx.random.split(mx.random.key(0), 2))
        caches = prefill_prompts(model, prompts)
        tok = SimpleNamespace(eos_token_ids=[])  # (rows run to the length limit)
        out = rollout._decode(model, tok, [[p[-1]] for p in prompts], caches, cfg, samplers)
        return [ids for ids, _, _, _ in out]

    assert decode_traces(model) is None
    first = turn(model)
    traces = decode_traces(model)
    assert traces > 0 and decode_traces(other) is None
    decoder = rollout.compiled_decoder(model)
    assert rollout.compiled_decoder(model) is decoder
    assert turn(model) == first and decode_traces(model) == traces  # no new trace
    model_ref, decoder_ref = weakref.ref(model), weakref.ref(decoder)
    del model, decoder
    gc.collect()
    assert model_ref() is None and decoder_ref() is None


def test_a_training_run_is_the_same_with_compiled_decode(tiny_model_dir, tmp_path, monkeypatch):
    """Two steps of the multi-turn toy recipe (adapters folded for sampling, as in
    every run): the same episodes, so the same rewards, lengths and samples."""
    import mlx_grpo.decode as decode_mod

    widths = [0]  # the cache widths the compiled turns take

    def recorded(columns, size=decode_mod.capacity):
        widths.append(size(columns))
        return widths[-1]

    monkeypatch.setattr(decode_mod, "capacity", recorded)
    logs = {}
    for name, flag in [("plain", "false"), ("compiled", "true")]:
        args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}"]
        args += [f"--output.dir={tmp_path}", f"--output.run={name}", "--train.steps=2"]
        args += ["--train.sample_every=1", f"--rollout.compile_decode={flag}"]
        assert cmd_train(args) == 0
        samples = (tmp_path / name / "samples.jsonl").read_text().splitlines()
        logs[name] = [json.loads(x) for x in samples]
        logs[name + "/entropy"] = [r.pop("entropy") for r in logs[name]]
        metrics = [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        logs[name + "/m"] = [(m["reward/mean"], m["completion/len_mean"]) for m in metrics]
        logs[name + "/traces"] = [m.get("compile/decode_traces") for m in metrics]
    assert logs["compiled"] == logs["plain"] and logs["plain"]
    assert logs["compiled/m"] == logs["plain/m"]
    # Each episode's mean entropy: its logits through the layers' reductions and an
    # attention row over the cache's width on the compiled path (the plain path's rows
    # are no longer).
    config = json.loads((tiny_model_dir / "config.json").read_text())
    n = tiny_additions(config) + 2 * max(widths)
    assert_f32_close(logs["compiled/entropy"], logs["plain/entropy"], n, "entropy")
    assert logs["plain/traces"] == [None, None]
    assert 0 < logs["compiled/traces"][0] <= logs["compiled/traces"][1]


def test_greedy_evaluation_is_the_same_with_compiled_decode(tiny):
    """The held-out evaluation (greedy, multi-turn): the same replies either way."""
    from mlx_grpo.evaluate import evaluate
    from mlx_grpo.recipe import Recipe

    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("eval", 6, 0)
    texts, traces = {}, {}
    for flag in (False, True):
        cfg = RolloutConfig(max_new_tokens=12, max_turns=3, compile_decode=flag)
        texts[flag] = [r.texts for r in evaluate(model, tok, recipe, tasks, cfg)]
        traces[flag] = decode_traces(model)
    assert texts[True] == texts[False]
    assert len({t[0] for t in texts[True]}) > 1  # the tasks' episodes differ
    assert traces[False] is None and traces[True] > 0  # only the compiled run traced


def _family_model(family: str, **extra):
    """A small random model of one mlx_lm family, with the fast attention and MLP the
    loader gives on a Linux CPU (`device.adapt_model`)."""
    from mlx_lm.models import llama, qwen2, qwen3

    from mlx_grpo.cpu.layers import use_fast_attention, use_fast_swiglu

    module = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}[family]
    args = dict(
        model_type=family,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    if family == "qwen3":
        args["head_dim"] = 16
    mx.random.seed(7)
    model = module.Model(module.ModelArgs(**{**args, **extra}))
    model.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters()))
    use_fast_attention(model), use_fast_swiglu(model)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    "family,extra",
    [
        ("llama", dict(attention_bias=True)),  # biases on every projection
        ("llama", dict(tie_word_embeddings=True, rope_scaling={"type": "linear", "factor": 2.0})),
        ("qwen2", {}),  # biases on q, k and v
        ("qwen3", {}),  # q and k norms
    ],
)
def test_the_lean_step_gives_what_the_model_call_gives(family, extra):
    """`lean_logits` against mlx_lm's model call on the same static cache: rows whose
    prefixes start at different columns and whose positions differ, the logits and the
    written keys and values the same up to float32 rounding."""
    from mlx_grpo.decode import StaticCache, lean_applies, lean_logits, lean_weights

    model = _family_model(family, **extra)
    assert lean_applies(model)
    layers, hkv, d, cap = len(model.layers), 2, 16, 24
    mx.random.seed(3)
    kv = [mx.random.normal((3, hkv, cap, d)) for _ in range(2 * layers)]
    left, width = mx.array([0, 5, 11]), 17  # each row's first column; the step writes at 17
    tokens = mx.array([4, 50, 96])

    def caches():
        pos, zero = mx.array(width), mx.array(0)
        return [
            StaticCache(kv[2 * i], kv[2 * i + 1], pos, left, zero, left, left)
            for i in range(layers)
        ]

    want_cache, got_cache = caches(), caches()
    want = model(tokens[:, None], cache=want_cache)[:, -1, :]
    got = lean_logits(model, tokens, got_cache, lean_weights(model))
    # Each logit: two layers of sums of at most 96 terms, attention rows of at most
    # `cap` keys, and the head's sum over 64.
    additions = 2 * (96 + cap) + 64
    assert_f32_close(got, want, additions, "logits")
    for a, b in zip(want_cache, got_cache):
        assert_f32_close(b.keys, a.keys, additions, "keys")
        assert_f32_close(b.values, a.values, additions, "values")


def test_the_lean_step_leaves_live_adapters_and_other_layers_to_the_model_call(tiny):
    """Projections that are LoRA layers (sampling without folding) or a rotary
    embedding of interleaved pairs: the compiled step calls the model."""
    from mlx_grpo.decode import lean_applies

    model, _ = tiny
    assert lean_applies(model)
    apply_lora(model, LoRAConfig(rank=4))
    assert not lean_applies(model)
    assert not lean_applies(_family_model("llama", rope_traditional=True))
