"""Off-policy guidance: a demonstration is the episode that sampling its replies would
play, it fills only the groups without signal that it beats, and the update learns it
while every on-policy figure stays on-policy."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_grpo.cli import cmd_train
from mlx_grpo.config import RolloutConfig
from mlx_grpo.guidance import demonstration, guide_groups
from mlx_grpo.recipe import Recipe, Scored
from mlx_grpo.rollout import encode_prompt, rollout_tasks

TOY_ENV = Path(__file__).parent / "data" / "toy_env"
CFG = RolloutConfig(max_new_tokens=6, max_turns=3, temperature=1.0)


def _raw(tokenizer, ids) -> str:
    return tokenizer._tokenizer.decode(ids, skip_special_tokens=False)


def _prompt(recipe, tok, task):
    return encode_prompt(tok, recipe.first_messages(task, recipe.make_env(task)), 10**6)


def test_a_demonstration_is_its_conversation_in_the_chat_template(tiny):
    """Its tokens are the chat template's rendering of the conversation (replies and the
    env's observations), each reply closed by EOS, only the replies in the loss; the
    env played it to the end and the reward scores it."""
    _, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    eos = tok.eos_token_id
    for task in recipe.tasks("train", 3, 0):  # 1, 2 and 3 turns
        prompt = _prompt(recipe, tok, task)
        demo = demonstration(recipe, tok, task, 5, prompt, CFG)
        replies = ["ok"] * task.payload["turns"]
        assert demo.prompt_index == 5 and demo.finish_reason == "stop"
        assert demo.episode.done and demo.episode.actions == replies
        conv = recipe.first_messages(task, recipe.make_env(task))
        for reply, result in zip(replies[:-1], demo.episode.results):
            conv += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": result.observation},
            ]
        expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        expected += replies[-1] + _raw(tok, [eos])
        assert _raw(tok, prompt + demo.tokens) == expected
        in_loss = [t for t, m in zip(demo.tokens, demo.loss_mask) if m]
        assert in_loss == (tok.encode("ok", add_special_tokens=False) + [eos]) * len(replies)
        assert recipe.score(task, demo.episode).reward == pytest.approx(1.5)


def test_a_policy_demonstrates_turn_by_turn_as_its_replies_would(tiny, monkeypatch):
    """`demonstrate` may return a policy asked at each turn with the env's last
    observation; it gives the completion that its replies, listed, give."""
    _, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    task = recipe.tasks("train", 3, 0)[2]  # 3 turns
    prompt = _prompt(recipe, tok, task)
    listed = demonstration(recipe, tok, task, 0, prompt, CFG)
    seen = []

    def policy(env, observation):
        seen.append(observation)
        return "ok"

    monkeypatch.setattr(recipe.module, "demonstrate", lambda task: policy)
    asked = demonstration(recipe, tok, task, 0, prompt, CFG)
    assert (asked.tokens, asked.loss_mask, asked.text) == (
        listed.tokens,
        listed.loss_mask,
        listed.text,
    )
    assert seen == ["start", "turn 1: 2 chars", "turn 2: 2 chars"]
    monkeypatch.setattr(recipe.module, "demonstrate", lambda task: lambda env, obs: None)
    gave_up = demonstration(recipe, tok, task, 0, prompt, CFG)
    assert gave_up.tokens == [] and not gave_up.episode.done and gave_up.finish_reason == "length"


def test_a_demonstration_longer_than_a_turn_allows_is_left_out(tiny):
    _, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0}, {})
    task = recipe.tasks("train", 1, 0)[0]
    short = RolloutConfig(max_new_tokens=1, max_turns=3)  # "ok" + EOS is 2 tokens or more
    assert demonstration(recipe, tok, task, 0, _prompt(recipe, tok, task), short) is None


def test_guidance_fills_only_the_zero_variance_groups_that_the_demonstration_beats(tiny):
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("train", 3, 0)
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, tasks, 4, CFG)
    # Group 0: all equal below the best (1.5); group 1: all at the best; group 2: mixed.
    rewards = [[1.0] * 4, [1.5] * 4, [1.0, 1.5, 1.0, 1.0]]
    scored = [Scored(r, {"r": r}) for group in rewards for r in group]
    before_c, before_s = list(rollout.completions), list(scored)
    replaced = guide_groups(recipe, tok, tasks, rollout, scored, CFG)
    assert replaced == [(3, pytest.approx(1.5))]
    demo = demonstration(recipe, tok, tasks[0], 0, rollout.prompts[0], CFG)
    got = rollout.completions[3]
    assert (got.tokens, got.loss_mask, got.text) == (demo.tokens, demo.loss_mask, demo.text)
    assert scored[3].reward == pytest.approx(1.5) and scored[3].components["finished"] == 1.0
    for row in [r for r in range(12) if r != 3]:
        assert rollout.completions[row] is before_c[row] and scored[row] is before_s[row]


GUIDED_RECIPE = """
from mlx_grpo.env import StepResult
from mlx_grpo.recipe import Task

def make_tasks(split, n, seed):
    return [Task(id=f"{split}-{seed}-{i}", level=1,
                 messages=[{"role": "system", "content": f"answer yes, twice ({i})"}],
                 payload={}) for i in range(n)]

class Env:
    def __init__(self):
        self.n = 0
    def reset(self):
        return "go"
    def step(self, action):
        self.n += 1
        return StepResult("again", self.n >= 2, {})

def make_env(task):
    return Env()

def demonstrate(task):
    return ["yes", "yes"]

def reward(task, episode):
    return {"match": float(episode.actions == ["yes", "yes"])}
"""

GUIDED_TOML = """
[recipe]
weights = { match = 1.0 }
train_size = 16
eval_size = 4
[rollout]
max_new_tokens = 4
max_turns = 2
temperature = 1.0
[grpo]
num_generations = 4
[optimizer]
learning_rate = 1e-2
[train]
steps = 3
batch_size = 2
[output]
save_every = 3
live = "no"
"""


def _demo_logprob(model, tok, recipe, task) -> float:
    """Sum of the demonstration's reply-token log-probs, from one plain forward."""
    prompt = _prompt(recipe, tok, task)
    demo = demonstration(recipe, tok, task, 0, prompt, RolloutConfig(max_new_tokens=4))
    seq = prompt + demo.tokens
    logits = model(mx.array(seq)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = len(prompt)
    return sum(
        logp[n + i - 1, t].item() for i, (t, m) in enumerate(zip(demo.tokens, demo.loss_mask)) if m
    )


def test_guided_update_learns_the_demonstration_and_logs_on_policy_figures(
    tiny_model_dir, tmp_path
):
    """No sampled episode succeeds, so without guidance nothing trains; with it every
    group holds the demonstration, the update raises its log-probability, and the
    reward, zero-variance and curriculum figures are still the samples' own."""
    from mlx_lm import load

    recipe_dir = tmp_path / "guided"
    recipe_dir.mkdir()
    (recipe_dir / "tasks.py").write_text(GUIDED_RECIPE)
    (recipe_dir / "recipe.toml").write_text(GUIDED_TOML)
    runs = {}
    for name, flag in [("off", []), ("on", ["--grpo.guidance=true"])]:
        args = ["--recipe", str(recipe_dir), f"--model.path={tiny_model_dir}"]
        args += [f"--output.dir={tmp_path}", f"--output.run={name}", *flag]
        assert cmd_train(args) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(x) for x in lines]
    for off, on in zip(runs["off"], runs["on"]):
        assert off["groups/trained"] == 0 and off["adapter/delta_norm"] == 0.0
        assert "guidance/groups" not in off
        assert on["guidance/groups"] == 2 and on["groups/trained"] == 2
        assert on["adapter/delta_norm"] > 0
        for key in ["reward/mean", "reward/match", "groups/zero_variance_frac"]:
            assert on[key] == off[key], key
        assert on["groups/zero_variance_frac"] == 1.0 and on["reward/mean"] == 0.0
        curriculum = [k for k in off if k.startswith("curriculum/")]
        assert curriculum and all(on[k] == off[k] for k in curriculum)

    recipe = Recipe(str(recipe_dir), {"match": 1.0}, {})
    task = recipe.tasks("eval", 1, 0)[0]  # held out: the update never saw its prompt
    base, tok = load(str(tiny_model_dir))
    guided, _ = load(str(tiny_model_dir), adapter_path=str(tmp_path / "on"))
    before = _demo_logprob(base, tok, recipe, task)
    after = _demo_logprob(guided, tok, recipe, task)
    assert after > before + 1.0, (before, after)
