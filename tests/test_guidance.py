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
GUIDED = Path(__file__).parent / "data" / "toy_guided"
TOY = Path(__file__).parent / "data" / "toy"
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


def test_guidance_fills_only_the_zero_variance_groups_that_the_demonstration_beats(
    tiny, monkeypatch
):
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("train", 6, 0)
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, tasks, 4, CFG)
    # The demonstration scores the best, 1.5. Group 0: all equal below it; 1: all at it;
    # 2: one sample at it; 3: its reward raised; 4: its demonstration raises; 5: mixed,
    # all below it (the lowest sample makes way).
    rewards = [[1.0] * 4, [1.5] * 4, [1.0, 1.5, 1.0, 1.0], [0.0] * 4, [1.0] * 4]
    rewards += [[0.5, 0.0, 1.0, 1.0]]
    scored = [Scored(r, {"r": r}) for group in rewards for r in group]
    scored[12:16] = [Scored(0.0, {}, error="RuntimeError: boom")] * 4
    own = recipe.module.demonstrate

    def demonstrate(task):
        if task.id == tasks[4].id:
            raise RuntimeError("no script for this one")
        return own(task)

    monkeypatch.setattr(recipe.module, "demonstrate", demonstrate)
    before_c, before_s, said = list(rollout.completions), list(scored), []
    replaced = guide_groups(recipe, tok, tasks, rollout, scored, CFG, said.append)
    assert replaced == [(3, pytest.approx(1.5)), (21, pytest.approx(1.5))]
    assert len(said) == 1 and tasks[4].id in said[0] and "no script" in said[0]
    for group, row in [(0, 3), (5, 21)]:
        demo = demonstration(recipe, tok, tasks[group], group, rollout.prompts[group], CFG)
        got = rollout.completions[row]
        assert (got.tokens, got.loss_mask, got.text) == (demo.tokens, demo.loss_mask, demo.text)
        assert scored[row].reward == pytest.approx(1.5)
        assert scored[row].components["finished"] == 1.0
    for row in [r for r in range(24) if r not in (3, 21)]:
        assert rollout.completions[row] is before_c[row] and scored[row] is before_s[row]


def test_a_group_with_a_success_is_not_guided_though_the_demonstration_scores_more(tiny):
    """A success that lost a little elsewhere (an extra step's efficiency) is a success:
    the group has its signal, and a demonstration must not take a sample's place."""
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("train", 1, 0)
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, tasks, 4, CFG)
    scored = [Scored(1.0, {"success": 1.0})] + [Scored(0.0, {"success": 0.0})] * 3
    assert guide_groups(recipe, tok, tasks, rollout, list(scored), CFG) == []
    # credit.signal_component names what counts: here nobody scored on it.
    guided = guide_groups(recipe, tok, tasks, rollout, list(scored), CFG, signal="finished")
    assert guided == [(3, pytest.approx(1.5))]


def test_a_recipe_that_scores_groups_whole_judges_the_demonstration_among_them(tiny, monkeypatch):
    """With `reward_batch` a reward may depend on the whole group: the group is scored
    again with the demonstration in, and guided only if it then beats the others."""
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "solved": 1.0}, {})
    tasks = recipe.tasks("train", 1, 0)
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, tasks, 4, CFG)
    scored = [Scored(1.0, {"finished": 1.0, "solved": 0.0})] * 4

    def reward_batch(tasks, groups):  # "solved": someone in the group said "ok"
        return [
            [
                {"finished": float(e.done), "solved": float(any(x.text == "ok" for x in g))}
                for e in g
            ]
            for g in groups
        ]

    monkeypatch.setattr(recipe.module, "reward_batch", reward_batch, raising=False)
    assert guide_groups(recipe, tok, tasks, rollout, scored, CFG) == []  # 2 = 2: no gain
    assert all(s.reward == 1.0 for s in scored)  # scored alone, it would have won 2 to 1


def test_guidance_needs_a_recipe_that_demonstrates(tiny_model_dir, tmp_path):
    from mlx_grpo.trainer import TrainingError

    capitals = Path(__file__).parent / "data" / "capitals"
    args = ["--recipe", str(capitals), f"--model.path={tiny_model_dir}", "--guidance.enabled=true"]
    with pytest.raises(TrainingError, match=r"^guidance.enabled: recipe .* defines no demonstrate"):
        cmd_train([*args, f"--output.dir={tmp_path}", "--output.run=x"])


def test_a_single_turn_demonstration_is_its_reply_and_eos(tiny):
    _, tok = tiny
    recipe = Recipe(str(TOY), {"ascii": 1.0}, {})
    task = recipe.tasks("train", 1, 0)[0]
    prompt = encode_prompt(tok, task.messages, 10**6)
    demo = demonstration(recipe, tok, task, 2, prompt, RolloutConfig(max_new_tokens=8))
    assert demo.tokens == tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id]
    assert (demo.text, demo.prompt_index, demo.finish_reason, demo.loss_mask) == (
        "ab",
        2,
        "stop",
        None,
    )


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

    recipe_dir = GUIDED
    runs = {}
    for name, flag in [("off", []), ("on", ["--guidance.enabled=true"])]:
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
        # The demonstration rows are reported apart: 2 of the update's 8 rows here.
        assert 0 < on["guidance/token_frac"] < 1 and on["guidance/logp"] < 0
        assert on["guidance/entropy"] > 0 and on["entropy"] > 0
        for key in ["reward/mean", "reward/match", "groups/zero_variance_frac"]:
            assert on[key] == off[key], key
        assert on["groups/zero_variance_frac"] == 1.0 and on["reward/mean"] == 0.0
        curriculum = [k for k in off if k.startswith("curriculum/")]
        assert curriculum and all(on[k] == off[k] for k in curriculum)
    # The policy takes the demonstrations in over the run.
    assert runs["on"][-1]["guidance/logp"] > runs["on"][0]["guidance/logp"] + 0.1

    recipe = Recipe(str(recipe_dir), {"match": 1.0}, {})
    task = recipe.tasks("eval", 1, 0)[0]  # held out: the update never saw its prompt
    base, tok = load(str(tiny_model_dir))
    guided, _ = load(str(tiny_model_dir), adapter_path=str(tmp_path / "on"))
    before = _demo_logprob(base, tok, recipe, task)
    after = _demo_logprob(guided, tok, recipe, task)
    assert after > before + 1.0, (before, after)


def test_a_demonstration_that_gives_up_before_the_end_is_left_out(tiny, monkeypatch):
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"short": 1.0}, {})  # pays short replies, done or not
    tasks = [t for t in recipe.tasks("train", 3, 0) if t.payload["turns"] == 3]
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, tasks, 4, CFG)
    scored = [Scored(0.0, {"short": 0.0})] * 4
    replies = iter(["ok"])
    monkeypatch.setattr(recipe.module, "demonstrate", lambda t: lambda e, o: next(replies, None))
    assert guide_groups(recipe, tok, tasks, rollout, scored, CFG) == []


@pytest.mark.parametrize("mode", ["group", "demonstration"])
def test_guided_advantages_push_down_the_samples_only_in_group_mode(
    tiny_model_dir, tmp_path, monkeypatch, mode
):
    """Every sample of the toy scores 0 and its demonstration 1. In `group` mode the
    advantages are those of the group with the demonstration in (numpy: (r - mean) /
    (unbiased std + 1e-4)); in `demonstration` mode the samples keep their own group's
    advantage, 0 here, and only the demonstration row is pushed up; its samples, which
    had no signal of their own, leave the loss (an empty mask) and the demonstration
    trains alone."""
    import numpy as np

    import mlx_grpo.trainer as trainer

    seen, trainer_loss = [], trainer.grpo_loss

    def recording_loss(model, batch, cfg):
        seen.append((np.array(batch.advantages), np.array(batch.guided), np.array(batch.mask)))
        return trainer_loss(model, batch, cfg)

    monkeypatch.setattr(trainer, "grpo_loss", recording_loss)
    args = ["--recipe", str(GUIDED), f"--model.path={tiny_model_dir}"]
    args += [f"--output.dir={tmp_path}", "--output.run=r", "--guidance.enabled=true"]
    args += ["--engine.update_lanes=1"]  # one loss call an update, on the whole batch
    assert cmd_train([*args, f"--guidance.advantage={mode}"]) == 0
    g = 4  # the toy's group size
    rewards = np.zeros(g)
    rewards[-1] = 1.0  # the demonstration takes the last of the lowest samples' place
    centred = rewards - rewards.mean()
    mixed = centred / (np.sqrt((centred**2).sum() / (g - 1)) + 1e-4)
    want = mixed if mode == "group" else np.where(rewards > 0, mixed, 0.0)
    assert len(seen) == 3  # one update a step
    for adv, guided, mask in seen:
        assert guided.tolist() == [0, 0, 0, 1] * 2
        np.testing.assert_allclose(adv, np.tile(want, 2), rtol=1e-6, atol=1e-7)
        weight = mask.max(axis=1)  # alike samples fold into one row (fold_alike_rows)
        if mode == "group":  # every sample counted once, the demonstration apart
            assert weight.reshape(2, g).sum(axis=1).tolist() == [g, g]
            assert weight[g - 1 :: g].tolist() == [1.0, 1.0]
        else:
            assert (weight > 0).tolist() == [False, False, False, True] * 2
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x)["adapter/delta_norm"] > 0 for x in lines)


def test_a_group_started_partway_plays_on_from_the_demonstrations_state(tiny):
    """`starts`: the prompt is the chat template's rendering of the conversation with the
    demonstration's first replies and the env's answers in; every episode holds those
    turns (the reward sees them, `max_turns` counts them) but the completion's tokens
    are the policy's own from there on."""
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    task = [t for t in recipe.tasks("train", 3, 0) if t.payload["turns"] == 3][0]
    cfg = RolloutConfig(max_new_tokens=4, max_turns=3, temperature=1.0)
    mx.random.seed(0)
    rollout = rollout_tasks(model, tok, recipe, [task, task], 4, cfg, starts=[["ok", "ok"], []])
    conv = recipe.first_messages(task, recipe.make_env(task))
    for k in (1, 2):
        conv += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": f"turn {k}: 2 chars"},
        ]
    want = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert _raw(tok, rollout.prompts[0]) == want
    assert rollout.prompts[1] == _prompt(recipe, tok, task)
    for c in rollout.completions[:4]:
        assert c.episode.actions[:2] == ["ok", "ok"] and c.episode.turns == 3  # 1 turn left
        assert c.episode.done  # the env's third step ends it, whatever the reply
        assert sum(c.loss_mask) == len(c.tokens)  # one reply, no env tokens after it
        assert c.text == "\n".join(c.episode.actions)
    assert all(len(c.episode.actions) >= 1 for c in rollout.completions[4:])
    scored = recipe.score_rollout([task, task], rollout)
    assert all(s.components["finished"] == 1.0 for s in scored[:4])
    # Two turns in all: after the demonstration's first, the policy has one left.
    two = RolloutConfig(max_new_tokens=4, max_turns=2, temperature=1.0)
    rollout = rollout_tasks(model, tok, recipe, [task], 4, two, starts=[["ok"]])
    for c in rollout.completions:
        assert c.episode.turns == 2 and not c.episode.done and c.finish_reason == "length"


def test_demo_starts_draw_a_share_of_tasks_and_a_uniform_point_inside_each_demonstration():
    import numpy as np

    from mlx_grpo.guidance import demonstration_starts

    recipe = Recipe(str(TOY_ENV), {"finished": 1.0}, {})
    tasks = recipe.tasks("train", 3, 0)  # demonstrations of 1, 2 and 3 replies
    cfg = RolloutConfig(max_turns=3)
    assert demonstration_starts(recipe, tasks, 0.0, np.random.default_rng(0), cfg) == [[]] * 3
    rng = np.random.default_rng(0)
    drawn = [demonstration_starts(recipe, tasks, 1.0, rng, cfg) for _ in range(400)]
    assert all(d[0] == [] and d[1] == ["ok"] for d in drawn)  # 1 turn: nothing to skip
    ks = np.array([len(d[2]) for d in drawn])
    assert set(ks.tolist()) == {1, 2} and abs((ks == 1).mean() - 0.5) < 0.125  # 5 sigma
    half = [demonstration_starts(recipe, tasks, 0.5, rng, cfg)[2] for _ in range(400)]
    assert abs(np.mean([h == [] for h in half]) - 0.5) < 0.125  # 5 sigma
    short = RolloutConfig(max_turns=2)  # a demonstration that needs 3 turns does not fit
    assert demonstration_starts(recipe, tasks, 1.0, rng, short)[2] == []


def test_demo_starts_train_on_groups_started_partway_that_the_curriculum_does_not_hear(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Every group starts partway (share 1): the update trains on them, the metrics
    count them apart, and the curriculum hears only the tasks whose groups started at
    the start (here those whose demonstration takes one turn)."""
    from mlx_grpo.curriculum import LearnabilityCurriculum

    heard, update = [], LearnabilityCurriculum.update

    def recording(self, tasks, rewards):
        heard.append([t.payload["turns"] for t in tasks])
        return update(self, tasks, rewards)

    monkeypatch.setattr(LearnabilityCurriculum, "update", recording)
    args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}", "--guidance.demo_starts=1"]
    args += [f"--output.dir={tmp_path}", "--output.run=r", "--curriculum.start_levels=3"]
    assert cmd_train(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(heard) == 3
    for row, turns in zip(rows, heard):
        assert set(turns) <= {1}
        assert row["starts/groups"] + len(turns) == 2  # train.batch_size
        assert ("starts/reward_mean" in row) == (row["starts/groups"] > 0)
    assert sum(r["starts/groups"] for r in rows) > 0
