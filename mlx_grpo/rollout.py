"""Group rollouts: G sampled completions (or episodes) for each of B prompts, in one batch.

Each prompt is prefilled once (the prefix all prompts share, once for all of them); its
KV cache is shared by its G samples, which then decode together with every other
prompt's samples (one forward per new token for all B*G sequences): through the
compiled decoder (`mlx_grpo.decode`), or mlx_lm's BatchGenerator where that does not
apply (`_decode`). The sampled token ids are kept
as they are (never re-tokenised), including the stop token when there is one.

Multi-turn episodes (`play_episodes`) run turn by turn: after each turn every live
episode's environment answers, its observation is appended as template tokens (masked
out of the loss), and all live episodes decode their next turn together, each on top of
its group's shared prompt cache. Each reply enters the sequence as the ids sampled, not
as its text encoded again. An environment that offers tools (`prompt_tools`, a
`tools.ToolEnv`'s) has them rendered in its episode's prompt (`episode_prompt`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_grpo import fastmath
from mlx_grpo.config import RolloutConfig
from mlx_grpo.decode import CompiledDecoder, supported
from mlx_grpo.env import Env, EnvError, Episode, env_call, ill_formed, turn_spans
from mlx_grpo.models import adapters_folded
from mlx_grpo.tools import Tool, as_tool, episode_tool_stats, render_prompt


@dataclass
class Completion:
    """One sampled completion of one prompt, or one episode of several turns."""

    prompt_index: int
    tokens: list[int]  # sampled ids, stop token included when finish_reason == "stop"
    text: str  # decoded, without the stop token (episodes: the model's replies)
    # "stop" (EOS, or the line break of `stop_at_newline`), "length" (hit
    # max_new_tokens / the turn limit) or "ill_formed" (`rollout.end_on_ill_formed`)
    finish_reason: str
    # Episodes: 1 where `tokens` holds a model token, 0 for the environment's tokens.
    loss_mask: list[int] | None = None
    episode: Episode | None = None
    demonstration: bool = False  # the recipe's demonstration, not a sample (guidance.enabled)
    # Per sampled token (the model's tokens, in order): the entropy of the untempered
    # policy's distribution it was drawn from, whatever later takes it out of the loss.
    # None for a demonstration.
    entropies: list[float] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def model_tokens(self) -> int:
        return len(self.tokens) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def entropy(self) -> float | None:
        """The mean of `entropies` (None without any)."""
        return sum(self.entropies) / len(self.entropies) if self.entropies else None


def ill_formed_turns(c: Completion) -> list[tuple[int, int]]:
    """[start, end) in `c.tokens` of the replies of episode `c` that its environment
    marked ill-formed (their step's `info["format"]` is False); none for a single-turn
    completion. The spans are this completion's own turns: the last ones of the episode,
    which may have started from turns played before (`rollout_tasks`' `starts`)."""
    if c.episode is None or c.loss_mask is None:
        return []
    spans = turn_spans(c.loss_mask)
    results = c.episode.results[len(c.episode.results) - len(spans) :]
    return [span for span, r in zip(spans, results) if ill_formed(r)]


@dataclass
class Rollout:
    """B prompts x G completions; completions are grouped by prompt, contiguously."""

    prompts: list[list[int]]
    completions: list[Completion]
    group_size: int
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    env_seconds: float = 0.0  # in the environments' reset and step (multi-turn), within seconds
    shared_tail_tokens: int = 0  # prefill saved by episodes that played alike (`share_tails`)

    @property
    def generated_tokens(self) -> int:
        return sum(c.model_tokens for c in self.completions)

    @property
    def tool_stats(self) -> list[dict]:
        """Each episode's tool calls and failures (`ToolStats.as_record`), for the episodes
        whose environment counts them (a ToolEnv's); [] for a recipe without tools."""
        envs = [c.episode.env for c in self.completions if c.episode is not None]
        return [s.as_record() for s in episode_tool_stats(envs)]


def encode_prompt(
    tokenizer, messages: list[dict], max_prompt_tokens: int, tools: Iterable[Tool] = ()
) -> list[int]:
    """Chat-template the messages, with `tools` rendered where given
    (`tools.render_prompt`); cut from the left so the generation prompt survives."""
    ids = render_prompt(tokenizer, messages, tools)
    return ids[-max_prompt_tokens:] if len(ids) > max_prompt_tokens else ids


def offered_tools(env) -> list[Tool]:
    """The tools an environment offers the model (its `prompt_tools`: Tools or
    functions with hints and docstrings); none for an environment without them."""
    return [as_tool(t, "prompt_tools") for t in getattr(env, "prompt_tools", None) or ()]


def episode_prompt(tokenizer, messages: list[dict], env, max_prompt_tokens: int) -> list[int]:
    """The prompt of an episode that starts from `messages` (`recipe.first_messages`) in
    `env`: `encode_prompt` with the tools `env` offers. With tools, an empty first
    observation (the task's messages ask, `reset` adds nothing) is left out rather than
    shown as an empty user turn, which strict templates refuse after a user turn (also
    where demonstrated turns follow it, `rollout_tasks`' `starts`)."""
    tools = offered_tools(env)
    if tools:
        messages = [m for m in messages if m != {"role": "user", "content": ""}]
    return encode_prompt(tokenizer, messages, max_prompt_tokens, tools)


def top_k_candidates(logprobs: mx.array, top_k: int, top_p: float) -> tuple[mx.array, mx.array]:
    """(token ids [N, k], their log-probs with the ones top-p drops at -inf), best first,
    from normalised log-probs [N, V] (what mlx_lm passes to a sampler).

    The same tokens as mlx_lm's `apply_top_p` then `apply_top_k` keep: top-p keeps the
    most probable tokens while the mass of those before them is < top_p (of the whole
    vocabulary), so within the k best it keeps a prefix of them. Sorting k values
    instead of the vocabulary is what makes it fast: mlx_lm's top-p sorts all ~50k
    log-probs of every row at every decode step, which on a CPU costs more than a
    small model's forward.
    """
    return _top_k_of(logprobs, None, top_k, top_p)


def _top_k_of(
    scores: mx.array, log_z: mx.array | None, top_k: int, top_p: float
) -> tuple[mx.array, mx.array]:
    """`top_k_candidates` of the log-probs `scores - log_z` ([N, V] and [N, 1]; None:
    `scores` are log-probs), subtracted for the k best only."""
    ids, vals = fastmath.top_k(scores, top_k)
    vals = vals.astype(mx.float32)
    vals = vals if log_z is None else vals - log_z
    order = mx.argsort(-vals, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    vals = mx.take_along_axis(vals, order, axis=-1)
    if top_p < 1.0:  # log-probs are normalised (the sampler contract): total mass 1
        probs = mx.exp(vals)
        before = mx.cumsum(probs, axis=-1) - probs  # mass of the better tokens
        vals = mx.where(before < top_p, vals, -mx.inf)
    return ids, vals


class KeyedSampler:
    """The rollout sampler of one sequence, drawing from its own key stream.

    A completion's tokens then depend on its key and its logits only, not on which
    other sequences share its batch: a group samples the same tokens whether one
    process rolls out the whole step or a rank of a data-parallel run rolls out its
    share. Filters are those of `mlx_lm.sample_utils.make_sampler`, in its order; the
    draw is by inverse CDF (`fastmath.categorical`, one exp a word, not two logs) from
    one uniform number of the row's key. `draw` samples many rows, each from its own
    sampler's key, in one batched call with the same tokens.
    """

    def __init__(self, cfg: RolloutConfig, key: mx.array):
        self.key = key
        self.temp = cfg.temperature
        self.top_k, self.top_p = cfg.top_k, cfg.top_p
        self.settings = (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
        self.fast_top_k = cfg.top_k > 0 and cfg.min_p == 0.0
        self.filters = []
        if 0 < cfg.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, cfg.top_p))
        if cfg.min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, cfg.min_p))
        if cfg.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, cfg.top_k))

    def __call__(self, logprobs: mx.array) -> mx.array:
        return KeyedSampler.draw([self], logprobs)

    @staticmethod
    def draw(samplers: list[KeyedSampler], logprobs: mx.array) -> mx.array:
        """One token per row of `logprobs` ([n, V]), row i from `samplers[i]`'s key
        stream (the samplers share their settings); each key moves on one split."""
        tokens, keys = samplers[0].draw_rows(_stacked_keys(samplers), logprobs)
        _advance(samplers, keys)
        return tokens

    def draw_rows(self, keys: mx.array, logprobs: mx.array) -> tuple[mx.array, mx.array]:
        """(one token per row of `logprobs`, each row's next key) at this sampler's
        settings, row i drawn from `keys[i]` ([n, 2]): the pure function under `draw`."""
        u, after = _split_keys(keys)
        if self.fast_top_k:  # sort k values, not the vocabulary (see top_k_candidates)
            ids, vals = top_k_candidates(logprobs, self.top_k, self.top_p)
            return self._pick(ids, vals, u), after
        return self._filtered(logprobs, u), after

    def draw_logits(self, keys: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """`draw_rows` from logits, and the entropy of each row's distribution before
        temperature and filters: (tokens, entropies, next keys), what a compiled decode
        step (`mlx_grpo.decode`) takes. One exp over the vocabulary gives the normaliser,
        the entropy and, at temperature 1 without filters, the weights of the draw
        (`fastmath.softmax_parts`), where log-probs then `fastmath.entropy` take two and
        write the log-probs out in between."""
        u, after = _split_keys(keys)
        s, e, log_z, entropy = fastmath.softmax_parts(logits)
        if self.fast_top_k:
            ids, vals = _top_k_of(s, log_z, self.top_k, self.top_p)
            return self._pick(ids, vals, u), entropy, after
        if self.filters:
            return self._filtered(s - log_z, u), entropy, after
        # The weights exp(s / temp): their largest is 1, as categorical's.
        w = e if self.temp == 1.0 else fastmath.exp(s * (1.0 / self.temp))
        return fastmath.inverse_cdf(w, u).astype(mx.uint32), entropy, after

    def _filtered(self, logprobs: mx.array, u: mx.array) -> mx.array:
        """A draw at `u` from log-probs after mlx_lm's filters, at this temperature."""
        for f in self.filters:
            logprobs = f(logprobs)
        return fastmath.categorical(logprobs * (1.0 / self.temp), u=u)

    def _pick(self, ids: mx.array, vals: mx.array, u: mx.array) -> mx.array:
        pick = fastmath.categorical(vals * (1 / self.temp), u=u)
        return mx.take_along_axis(ids, pick[..., None].astype(mx.int32), axis=-1).squeeze(-1)


def _stacked_keys(samplers: list[KeyedSampler]) -> mx.array:
    """The samplers' keys as one [n, 2] array."""
    return samplers[0].key[None] if len(samplers) == 1 else mx.stack([s.key for s in samplers])


def _advance(samplers: list[KeyedSampler], keys: mx.array) -> None:
    """Each sampler takes its row of `keys` ([n, 2]) as its next key."""
    for i, s in enumerate(samplers):
        s.key = keys[i]


def _split_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """(this draw's uniform number per row [n, 1], each row's next key) from keys [n, 2]:
    each key splits into (next key, this draw's key)."""
    pairs = mx.vmap(mx.random.split)(keys)  # [n, 2, 2]
    return fastmath.uniform_rows(pairs[:, 1]), pairs[:, 0]


class GreedySampler:
    """Greedy decoding (the held-out evaluations, `compare`): the arg-max token, as
    mlx_lm's `make_sampler(temp=0)`; it speaks `KeyedSampler`'s `draw_logits`, so a
    compiled decode step (`mlx_grpo.decode`) can take it too."""

    settings = ("greedy",)

    def __init__(self):
        self.key = mx.random.key(0)  # unused: the draw takes no randomness

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    def draw_logits(self, keys: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return mx.argmax(logits, axis=-1), fastmath.softmax_parts(logits)[3], keys


def compiled_decode_applies(samplers: list | None, caches: list[list]) -> bool:
    """Whether `mlx_grpo.decode` can take a turn: keyed samplers of one setting, or a
    greedy one (the draws it compiles), on plain KV caches."""
    return (
        bool(samplers)
        and all(isinstance(s, (KeyedSampler, GreedySampler)) for s in samplers)
        and all(s.settings == samplers[0].settings for s in samplers)
        and supported(caches)
    )


def keyed_samplers(cfg: RolloutConfig, keys: mx.array) -> list[KeyedSampler]:
    """One `KeyedSampler` per row of `keys` ([N, 2], from `mx.random.split`)."""
    return [KeyedSampler(cfg, keys[i]) for i in range(keys.shape[0])]


def _samplers_or_fresh(sampler, cfg: RolloutConfig, n: int):
    """`sampler`, or when it is None `n` `KeyedSampler`s whose keys are split from a
    seed drawn from MLX's global random state (so `mx.random.seed` fixes what they
    draw)."""
    if sampler is not None:
        return sampler
    seed = mx.random.randint(0, 2**31 - 1, ()).item()
    return keyed_samplers(cfg, mx.random.split(mx.random.key(seed), n))


# Each model's compiled decoder, built on its first compiled turn and reused by every
# later one (its traces are the shapes compiled so far), by id(model): an nn.Module is
# a dict, not hashable. An entry holds a weak reference to its model, whose callback
# drops the entry when the model is freed; a decoder holds its model only while it
# decodes, so an entry never keeps a model alive.
_decoders: dict[int, tuple[weakref.ref, CompiledDecoder]] = {}


def compiled_decoder(model: nn.Module) -> CompiledDecoder:
    """The compiled decoder of `model` (built on first use, then kept while `model`
    lives)."""
    key = id(model)
    entry = _decoders.get(key)
    if entry is None or entry[0]() is not model:

        def forget(ref: weakref.ref) -> None:
            if _decoders.get(key, (None,))[0] is ref:
                del _decoders[key]

        entry = _decoders[key] = (weakref.ref(model, forget), CompiledDecoder(model))
    return entry[1]


def decode_traces(model: nn.Module) -> int | None:
    """The shapes `model`'s compiled decoder has traced so far (the metric
    `compile/decode_traces`); None when no turn of it has taken the compiled path."""
    entry = _decoders.get(id(model))
    return entry[1].traces if entry is not None and entry[0]() is model else None


def _prefill(model: nn.Module, prompt: list[int]) -> list:
    """A KV cache holding all prompt tokens but the last (which starts decoding)."""
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def cache_prefix(cache: list[KVCache], n: int) -> list[KVCache]:
    """New plain KV caches holding the first `n` positions of `cache`'s layers. Their
    keys and values are slices, new arrays: a prefill on top never writes into `cache`."""
    out = []
    for c in cache:
        own = KVCache()
        own.keys, own.values, own.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(own)
    return out


MIN_SHARED_PREFIX = 32  # tokens; below this, prefill each prompt whole


def prefill_prompts(model: nn.Module, prompts: list[list[int]]) -> list[list]:
    """`_prefill` of every prompt, with the longest prefix they all share (a recipe's
    system prompt and worked examples) computed once and copied into each cache, so
    that only what differs is prefilled per prompt. Models with other than plain
    KV caches (rotating, quantized) prefill each prompt whole."""
    heads = [p[:-1] for p in prompts]
    common = 0
    if len(heads) > 1:
        for column in zip(*heads):
            if any(t != column[0] for t in column[1:]):
                break
            common += 1
    base = make_prompt_cache(model)
    if common < MIN_SHARED_PREFIX or any(type(c) is not KVCache for c in base):
        return [_prefill(model, p) for p in prompts]
    model(mx.array(heads[0][:common])[None], cache=base)
    mx.eval([c.state for c in base])
    caches = []
    for head in heads:
        cache = cache_prefix(base, common)
        if len(head) > common:
            model(mx.array(head[common:])[None], cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


@lru_cache(maxsize=4)
def newline_ids(tokenizer) -> frozenset[int]:
    """The vocabulary's ids whose text holds a line break (special tokens aside)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return frozenset(
        i
        for i in range(len(tokenizer.get_vocab()))
        if i not in special and "\n" in tokenizer.decode([i])
    )


def stop_ids(tokenizer, cfg: RolloutConfig) -> set[int]:
    """The ids after which decoding stops: EOS, and line breaks under `stop_at_newline`."""
    ids = set(tokenizer.eos_token_ids)
    return ids | newline_ids(tokenizer) if cfg.stop_at_newline else ids


def reply_text(tokenizer, toks: list[int], reason: str, cfg: RolloutConfig) -> str:
    """A reply's text: without its EOS, and up to its first line break under
    `stop_at_newline` (the stop token may hold text before the break: `"]\\n"`)."""
    if reason == "stop" and toks and toks[-1] in tokenizer.eos_token_ids:
        toks = toks[:-1]
    text = tokenizer.decode(toks)
    return text.split("\n", 1)[0] if cfg.stop_at_newline else text


def _decode(
    model: nn.Module,
    tokenizer,
    tails: list[list[int]],
    caches: list[list],
    cfg: RolloutConfig,
    sampler,
) -> list[tuple[list[int], str, list, list[float]]]:
    """Sample one turn for every sequence: `tails[i]` is fed on top of `caches[i]` (a
    cache that stays untouched) and decoding starts after it. `sampler` is one sampler
    for all, or a list with one per sequence. Returns (sampled ids, finish reason, the
    sequence's own cache, the entropy of each sampled id's distribution) per sequence;
    that cache holds `caches[i]`, the tail and every sampled id, so a next turn feeds
    only what follows.

    Two paths, by what the model and samplers allow, not by speed: the compiled decoder
    (`mlx_grpo.decode`, the default on every device) where its draws and plain KV caches
    apply; else mlx_lm's `BatchGenerator` with each row's sampler, for any mlx_lm model,
    sampler and cache (sliding windows, SSM state, rows with no prefix yet) and under
    `rollout.compile_decode=false`. Both draw the same tokens for the same keys (up to
    float32 rounding of the logits)."""
    n = len(tails)
    samplers = sampler if isinstance(sampler, list) else None
    rows = [sampler] * n if isinstance(sampler, GreedySampler) else samplers
    if cfg.compile_decode and compiled_decode_applies(rows, caches):
        decoder = compiled_decoder(model)
        return decoder(tails, caches, cfg.max_new_tokens, stop_ids(tokenizer, cfg), rows)
    gen = BatchGenerator(
        model,
        max_tokens=cfg.max_new_tokens,
        stop_tokens=[[t] for t in sorted(stop_ids(tokenizer, cfg))],
        sampler=None if samplers else sampler,
        completion_batch_size=n,
        prefill_batch_size=n,
    )
    try:
        # The prompt caches are merged into a batch cache: never mutated.
        uids = gen.insert(tails, caches=caches, samplers=samplers)
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        done_cache: dict[int, list] = {}
        # Each step's entropies, queued behind the next step rather than waited for.
        steps: list[tuple[list[int], mx.array]] = []
        while responses := gen.next_generated():
            # Each response carries its row's normalised log-probs over the vocabulary.
            ent = fastmath.entropy(mx.stack([r.logprobs for r in responses]))
            mx.async_eval(ent)
            steps.append(([r.uid for r in responses], ent))
            for r in responses:
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
                    done_cache[r.uid] = r.prompt_cache
    finally:
        gen.close()
    entropies: dict[int, list[float]] = {u: [] for u in uids}
    for step_uids, ent in steps:
        for u, h in zip(step_uids, ent.tolist()):
            entropies[u].append(h)
    return [
        (
            tokens[u],
            "stop" if finish.get(u) == "stop" else "length",
            done_cache.get(u),
            entropies[u],
        )
        for u in uids
    ]


def generate_groups(
    model: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    group_size: int,
    cfg: RolloutConfig,
    sampler=None,
) -> Rollout:
    """Sample `group_size` completions for every prompt, all decoding in one batch.

    `sampler`: a list of B*G samplers (prompt-major: `keyed_samplers`), or one for
    every sequence (`GreedySampler`, or any mlx_lm sampler, which takes mlx_lm's
    generator); None: `keyed_samplers` of keys from MLX's global random state."""
    _check_prompts(prompts)
    tic = time.perf_counter()
    caches = prefill_prompts(model, prompts)
    prefill_s = time.perf_counter() - tic
    owners = [i for i in range(len(prompts)) for _ in range(group_size)]
    sampled = _decode(
        model,
        tokenizer,
        [[prompts[i][-1]] for i in owners],
        [caches[i] for i in owners],
        cfg,
        _samplers_or_fresh(sampler, cfg, len(owners)),
    )
    completions = []
    for owner, (toks, reason, _, ent) in zip(owners, sampled):
        completions.append(
            Completion(owner, toks, reply_text(tokenizer, toks, reason, cfg), reason, entropies=ent)
        )
    return Rollout(
        prompts=prompts,
        completions=completions,
        group_size=group_size,
        seconds=time.perf_counter() - tic,
        prefill_seconds=prefill_s,
    )


def _check_prompts(prompts: list[list[int]]) -> None:
    if not prompts:
        raise ValueError("generate_groups needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")


class TurnTemplate:
    """The chat template's tokens between the model's reply and its next turn: the
    end of the assistant turn, a user turn holding the observation, and the
    generation prompt. Worked out once from the template itself, so any chat model
    works."""

    _A, _B, _OBS = "\x00A\x00", "\x00B\x00", "\x00OBS\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        two = [{"role": "user", "content": self._A}, {"role": "assistant", "content": self._B}]
        head = tokenizer.apply_chat_template(two, tokenize=False)
        full = tokenizer.apply_chat_template(
            [*two, {"role": "user", "content": self._OBS}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not full.startswith(head) or self._B not in head:
            raise ValueError("multi-turn: the chat template does not extend a conversation")
        # e.g. "<|im_end|>\n" + "<|im_start|>user\n" | obs | "<|im_end|>\n<|im_start|>assistant\n"
        self.end_of_reply = head[head.rindex(self._B) + len(self._B) :]
        self.before_obs, self.after_obs = full[len(head) :].split(self._OBS)
        self.eos_texts = {t: tokenizer.decode([t]) for t in tokenizer.eos_token_ids}

    def tokens(self, observation: str, reply_tokens: list[int], stopped: bool) -> list[int]:
        """Tokens to append after a reply (which ended with an EOS token if `stopped`)."""
        closing = self.end_of_reply
        if stopped:
            eos = self.eos_texts.get(reply_tokens[-1], "")
            if closing.startswith(eos):
                closing = closing[len(eos) :]
        text = closing + self.before_obs + observation + self.after_obs
        return self.tokenizer.encode(text, add_special_tokens=False)


def play_episodes(
    model: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    envs: list[Env],
    group_size: int,
    cfg: RolloutConfig,
    sampler=None,
    episodes: list[Episode] | None = None,
) -> Rollout:
    """Play `group_size` episodes of each prompt's environment, turn by turn.

    `envs` holds one already-reset environment per episode, grouped by prompt
    (prompt i owns envs[i*G:(i+1)*G]); `prompts[i]` ends with the first observation.
    Each returned Completion holds every token after the prompt (replies and the
    environment's answers), with `loss_mask` marking the model's own tokens.
    `sampler` is as in `generate_groups` (a list: one per episode, across its turns).
    `episodes` (one per env) may hold turns already played, outside the prompt's loss
    (`rollout_tasks`' `starts`): they count toward `max_turns` and the reward sees them.
    Every environment is closed (when it has `close`) as soon as its episode ends, and
    all of them when this raises.
    """
    _check_prompts(prompts)
    if len(envs) != len(prompts) * group_size:
        raise ValueError(f"play_episodes: {len(envs)} envs for {len(prompts)}x{group_size}")
    sampler = _samplers_or_fresh(sampler, cfg, len(envs))
    template = TurnTemplate(tokenizer)
    tic = time.perf_counter()
    caches = prefill_prompts(model, prompts)
    prefill_s = time.perf_counter() - tic

    n = len(envs)
    owners = [i // group_size for i in range(n)]
    history: list[list[int]] = [[] for _ in range(n)]  # tokens after the prompt
    mask: list[list[int]] = [[] for _ in range(n)]
    entropies: list[list[float]] = [[] for _ in range(n)]
    episodes = episodes or [Episode(env=e) for e in envs]
    played = [len(e.actions) for e in episodes]
    reasons = ["length"] * n
    # What each live episode feeds next, on top of its cache: first the prompt's last
    # token on the group's prompt cache, then the environment's answer on the episode's
    # own cache (prompt + every turn so far), so no token is ever prefilled twice.
    tails = [[prompts[owners[i]][-1]] for i in range(n)]
    state = [caches[owners[i]] for i in range(n)]
    live = list(range(n))
    env_s, shared_tokens = 0.0, 0
    try:
        for turn in range(cfg.max_turns):
            shared_tokens += share_tails(model, live, owners, history, tails, state)
            sampled = _decode(
                model,
                tokenizer,
                [tails[i] for i in live],
                [state[i] for i in live],
                cfg,
                [sampler[i] for i in live] if isinstance(sampler, list) else sampler,
            )
            still = []
            for i, (toks, reason, cache, ent) in zip(live, sampled):
                state[i] = None  # free finished episodes' caches as we go
                entropies[i] += ent
                text = reply_text(tokenizer, toks, reason, cfg)
                try:
                    extra, reasons[i], seconds = take_turn(
                        episodes[i], text, toks, reason, played[i] + turn,
                        len(prompts[owners[i]]), history[i], mask[i], template, cfg,
                    )  # fmt: skip
                except EnvError as e:
                    raise EnvError(str(e), owners[i]) from e
                env_s += seconds
                if extra is None:
                    close_env(envs[i])
                    continue
                tails[i], state[i] = extra, cache
                still.append(i)
            live = still
            if not live:
                break
    finally:
        for env in envs:
            close_env(env)

    completions = [
        Completion(
            owners[i],
            history[i],
            episodes[i].text,
            "stop" if episodes[i].done else reasons[i],
            loss_mask=mask[i],
            episode=episodes[i],
            entropies=entropies[i],
        )
        for i in range(n)
    ]
    return Rollout(
        prompts=prompts,
        completions=completions,
        group_size=group_size,
        seconds=time.perf_counter() - tic,
        prefill_seconds=prefill_s,
        env_seconds=env_s,
        shared_tail_tokens=shared_tokens,
    )


def share_tails(
    model: nn.Module,
    live: list[int],
    owners: list[int],
    history: list[list[int]],
    tails: list[list[int]],
    state: list[list],
) -> int:
    """Live episodes of one group that have played the same tokens so far hold the same
    cache and feed the same tail (the environment's answer): that tail but its last token
    is prefilled once, on a copy of their cache, and each of them feeds only the last
    token. A policy that has grown sure of itself plays most of a group's episodes alike,
    so most of a turn's prefill is the same answer, once per episode, without this. The
    one-row prefill gives each episode what its own (batched) prefill would, up to float32
    rounding, so a near-tie draw can come out otherwise, as between the two decode paths.
    Updates `tails` and `state` in place; returns the prefill tokens saved. Caches other
    than plain `KVCache`s are left as they are."""
    alike: dict[tuple, list[int]] = {}
    for i in live:
        if len(tails[i]) > 1:
            alike.setdefault((owners[i], tuple(history[i])), []).append(i)
    saved = 0
    for rows in alike.values():
        first = rows[0]
        if len(rows) < 2 or any(type(c) is not KVCache for c in state[first]):
            continue
        cache = cache_prefix(state[first], state[first][0].offset)
        model(mx.array(tails[first][:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        saved += (len(rows) - 1) * (len(tails[first]) - 1)
        for i in rows:
            state[i], tails[i] = cache, tails[i][-1:]
    return saved


def take_turn(
    episode: Episode,
    text: str,
    toks: list[int],
    reason: str,
    turn: int,
    prompt_len: int,
    history: list[int],
    mask: list[int],
    template: TurnTemplate,
    cfg: RolloutConfig,
) -> tuple[list[int] | None, str, float]:
    """Play one reply (`text`, sampled as `toks`) in `episode.env` and extend the
    episode's tokens: the reply's (in the loss), then the environment's answer (not).
    Returns the answer's tokens, or None when the episode is over (done, out of turns
    or of `max_episode_tokens`, or an ill-formed reply under `end_on_ill_formed`), the
    finish reason so far, and the seconds in env.step."""
    tic = time.perf_counter()
    result = env_call("env.step()", episode.env.step, text)
    seconds = time.perf_counter() - tic
    episode.actions.append(text)
    episode.results.append(result)
    history += toks
    mask += [1] * len(toks)
    if result.done:
        episode.done = True
        return None, reason, seconds
    if cfg.end_on_ill_formed and ill_formed(result):
        return None, "ill_formed", seconds
    if turn + 1 == cfg.max_turns:
        return None, "length", seconds
    extra = template.tokens(result.observation, toks, reason == "stop")
    if prompt_len + len(history) + len(extra) >= cfg.max_episode_tokens:
        return None, "length", seconds
    history += extra
    mask += [0] * len(extra)
    return extra, reason, seconds


def close_env(env) -> None:
    """Let an environment free what its episode holds (a browser window...), if it can."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def rollout_tasks(
    model: nn.Module,
    tokenizer,
    recipe,
    tasks: list,
    group_size: int,
    cfg: RolloutConfig,
    sampler=None,
    starts: list[list[str]] | None = None,
) -> Rollout:
    """G completions (or, for a multi-turn recipe, G episodes) of every task.

    `starts[i]` (multi-turn) are replies played in task i's environments before its
    group samples: the prompt shows them as earlier turns with the environment's
    answers, so the group plays on from that state (`guidance.demo_starts`).

    At most `cfg.max_in_flight` samples are played at once: more tasks are played in
    batches of whole groups, one after another, and joined into one Rollout."""
    if not tasks:
        raise ValueError("rollout_tasks: no tasks")
    per = max(1, cfg.max_in_flight // group_size)  # tasks a batch
    parts = []
    with adapters_folded(model) if cfg.fold_adapters else nullcontext():
        for lo in range(0, len(tasks), per):
            hi = min(lo + per, len(tasks))
            rows = (
                sampler[lo * group_size : hi * group_size] if isinstance(sampler, list) else sampler
            )
            part_starts = starts[lo:hi] if starts else None
            parts.append(
                _rollout_tasks(
                    model, tokenizer, recipe, tasks[lo:hi], group_size, cfg, rows, part_starts
                )
            )
    return join_rollouts(parts)


def join_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts of consecutive task batches as one: prompts in order, each completion's
    `prompt_index` shifted by the prompts before its part, times added up."""
    if len(parts) == 1:
        return parts[0]
    prompts, completions, offset = [], [], 0
    for part in parts:
        prompts += part.prompts
        completions += [replace(c, prompt_index=c.prompt_index + offset) for c in part.completions]
        offset += len(part.prompts)
    return Rollout(
        prompts=prompts,
        completions=completions,
        group_size=parts[0].group_size,
        seconds=sum(p.seconds for p in parts),
        prefill_seconds=sum(p.prefill_seconds for p in parts),
        env_seconds=sum(p.env_seconds for p in parts),
        shared_tail_tokens=sum(p.shared_tail_tokens for p in parts),
    )


def play_prefix(
    env, first: list[dict], replies: list[str], name: str
) -> tuple[list[dict], Episode]:
    """Play `replies` in a reset `env` whose first messages are `first`: the messages
    with those turns in (reply, then the environment's answer) and the Episode so far."""
    episode, messages = Episode(env=env), list(first)
    for j, reply in enumerate(replies):
        result = env_call(f"{name}: env.step()", env.step, reply)
        episode.actions.append(reply)
        episode.results.append(result)
        if result.done:
            raise EnvError(f"{name}: the episode ended after {j + 1} of {len(replies)} replies")
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": result.observation},
        ]
    return messages, episode


def _rollout_tasks(model, tokenizer, recipe, tasks, group_size, cfg, sampler, starts) -> Rollout:
    if not recipe.multi_turn:
        if starts and any(starts):
            raise ValueError(f"recipe {recipe.name}: only multi-turn episodes start partway")
        prompts = [encode_prompt(tokenizer, t.messages, cfg.max_prompt_tokens) for t in tasks]
        return generate_groups(model, tokenizer, prompts, group_size, cfg, sampler)
    tic = time.perf_counter()
    envs = []
    prompts, episodes = [], []
    try:
        for t in tasks:
            envs += [
                env_call(f"task {t.id}: make_env()", recipe.make_env, t) for _ in range(group_size)
            ]
        for i, task in enumerate(tasks):
            group = envs[i * group_size : (i + 1) * group_size]
            prefix = starts[i] if starts else []
            played = [
                play_prefix(
                    env,
                    env_call(f"task {task.id}: env.reset()", recipe.first_messages, task, env),
                    prefix,
                    task.id,
                )
                for env in group
            ]
            firsts = [m for m, _ in played]
            if any(m != firsts[0] for m in firsts[1:]):
                raise EnvError(f"env.reset() differs between runs of {task.id}")
            schemas = [[t.schema for t in offered_tools(env)] for env in group]
            if any(s != schemas[0] for s in schemas[1:]):
                raise EnvError(f"the environments of {task.id} offer different tools")
            prompts.append(episode_prompt(tokenizer, firsts[0], group[0], cfg.max_prompt_tokens))
            episodes += [e for _, e in played]
    except BaseException as e:
        for env in envs:
            close_env(env)
        if isinstance(e, EnvError):
            raise EnvError(f"recipe {recipe.name}: {e}") from e
        raise
    reset_s = time.perf_counter() - tic
    try:
        rollout = play_episodes(
            model, tokenizer, prompts, envs, group_size, cfg, sampler, episodes=episodes
        )
    except EnvError as e:
        task = f"task {tasks[e.prompt].id}: " if e.prompt is not None else ""
        raise EnvError(f"recipe {recipe.name}: {task}{e}") from e
    rollout.seconds += reset_s
    rollout.env_seconds += reset_s
    return rollout
