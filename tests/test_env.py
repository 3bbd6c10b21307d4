"""Multi-turn episodes: the sequence the model sees is the chat template's own rendering
of the conversation, only the model's tokens are trained on, and the loop runs them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_f32_close, tiny_additions

from mlx_grpo.cli import cmd_train
from mlx_grpo.config import RolloutConfig
from mlx_grpo.recipe import Recipe
from mlx_grpo.rollout import rollout_tasks
from mlx_grpo.update import build_loss_inputs

TOY_ENV = Path(__file__).parent / "data" / "toy_env"


def _raw(tokenizer, ids) -> str:
    return tokenizer._tokenizer.decode(ids, skip_special_tokens=False)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _toy_episodes(model, tok):
    """(recipe, tasks, rollout): four episodes of each of six toy tasks (1-3 turns)."""
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("train", 6, 0)
    cfg = RolloutConfig(max_new_tokens=6, max_turns=3, temperature=1.0)
    mx.random.seed(3)
    return recipe, tasks, rollout_tasks(model, tok, recipe, tasks, 4, cfg)


def test_every_sampled_token_of_an_episode_logs_the_entropy_it_was_drawn_at(tiny, tiny_model_dir):
    """Each episode carries one entropy per model token, in order; each equals -sum p
    log p (float64) of a full forward pass over the prompt and the whole episode (its
    replies and the environment's answers) at the position that predicted that token.
    The step's `entropy/sampled` is their mean over every token of every episode:
    rewarded or not, trained or not."""
    from mlx_grpo.credit import CompletionRecord
    from mlx_grpo.monitor import step_metrics

    model, tok = tiny
    recipe, tasks, rollout = _toy_episodes(model, tok)
    got, want, longest = [], [], 0
    for c in rollout.completions:
        assert len(c.entropies) == c.model_tokens == sum(c.loss_mask)
        assert any(m == 0 for m in c.loss_mask) or c.episode.turns == 1
        prompt = rollout.prompts[c.prompt_index]
        seq = prompt + c.tokens
        longest = max(longest, len(seq))
        logits = np.array(model(mx.array(seq)[None])[0].astype(mx.float32), np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        h = -(np.exp(lp) * lp).sum(-1)
        got += c.entropies
        want += [h[len(prompt) - 1 + k] for k, m in enumerate(c.loss_mask) if m]
    assert max(c.episode.turns for c in rollout.completions) > 1
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert_f32_close(got, want, tiny_additions(config) + longest, "entropies")

    scored = recipe.score_rollout(tasks, rollout)
    records = [CompletionRecord.of(c, s, False) for c, s in zip(rollout.completions, scored)]
    rewards = np.array([s.reward for s in scored])
    n = len(records)
    out = step_metrics(1, [{"seconds": 1.0, "tokens": n}], records, rewards, mx.zeros(n),
                        np.zeros(len(tasks), bool), [])  # fmt: skip
    # float64 means of float64 sums of float32 values: exact to about 1e-15
    assert out["entropy/sampled"] == pytest.approx(float(np.mean(got)), rel=1e-12)


def test_episodes_render_exactly_the_chat_template(tiny):
    model, tok = tiny
    recipe, tasks, rollout = _toy_episodes(model, tok)
    assert len(rollout.completions) == 24
    eos = tok.eos_token_id
    for c in rollout.completions:
        task = tasks[c.prompt_index]
        ep = c.episode
        # Each env ends its episode after payload.turns replies (max_turns is 3).
        assert ep.turns == task.payload["turns"] and ep.done and c.finish_reason == "stop"
        replies = [c.tokens[a:b] for a, b in _runs(c.loss_mask)]
        assert len(replies) == ep.turns and c.model_tokens == sum(map(len, replies))
        # The whole sequence is what the template gives for the conversation.
        conv = recipe.first_messages(task, recipe.make_env(task))
        for reply, result in zip(replies[:-1], ep.results):
            body = reply[:-1] if reply[-1] == eos else reply
            conv += [
                {"role": "assistant", "content": _raw(tok, body)},
                {"role": "user", "content": result.observation},
            ]
        expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        expected += _raw(tok, replies[-1])
        assert _raw(tok, rollout.prompts[c.prompt_index] + c.tokens) == expected
        assert ep.actions == [tok.decode(r[:-1] if r[-1] == eos else r) for r in replies]

    batch = build_loss_inputs(rollout, mx.zeros(24), 18, False)
    mask = np.array(batch.mask)
    weight = mask.max(axis=1)  # alike episodes of a group fold into one row (fold_alike_rows)
    for i, c in enumerate(rollout.completions):
        assert mask[i, : len(c.tokens)].tolist() == [weight[i] * m for m in c.loss_mask]
        assert not mask[i, len(c.tokens) :].any()
    assert weight.reshape(6, 4).sum(axis=1).tolist() == [4.0] * 6  # each episode once
    assert 0 < mask.sum() < sum(len(c.tokens) for c in rollout.completions)


def test_an_ill_formed_reply_ends_a_training_episode_and_evaluation_plays_on(tiny, monkeypatch):
    """rollout.end_on_ill_formed: a training episode ends at its first reply that the
    environment marks ill-formed (finish reason "ill_formed"), checked by replaying each
    episode's replies in a fresh environment; held-out evaluation ignores the rule."""
    from mlx_grpo.evaluate import evaluate

    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    played = []

    class Marked(recipe.module.CountEnv):
        """The toy env, marking about half of the replies ill-formed by their bytes and turn
        (the tiny model's replies are all max_new_tokens long, so length cannot)."""

        def __init__(self, turns):
            super().__init__(turns)
            self.marks = []
            played.append(self)

        def step(self, action):
            self.marks.append((sum(action.encode()) + len(self.marks)) % 2 != 0)
            return super().step(action)._replace(info={"format": self.marks[-1]})

    monkeypatch.setattr(recipe.module, "make_env", lambda task: Marked(task.payload["turns"]))
    tasks = recipe.tasks("train", 6, 0)
    cfg = RolloutConfig(max_new_tokens=4, max_turns=3, temperature=1.0, end_on_ill_formed=True)
    mx.random.seed(3)
    rollout = rollout_tasks(model, tok, recipe, tasks, 8, cfg)
    reasons = []
    for c in rollout.completions:
        env = recipe.make_env(tasks[c.prompt_index])
        env.reset()
        *before, last = [env.step(a) for a in c.episode.actions]
        assert all(not r.done and r.info["format"] for r in before)
        cut = not last.done and not last.info["format"]
        assert last.done or cut  # max_turns (3) is every toy task's length or more
        assert c.finish_reason == ("ill_formed" if cut else "stop")
        assert len(_runs(c.loss_mask)) == c.episode.turns
        reasons.append(c.finish_reason)
    assert {"ill_formed", "stop"} <= set(reasons)
    assert any(c.episode.turns > 1 for c in rollout.completions)

    played.clear()
    results = evaluate(model, tok, recipe, recipe.tasks("eval", 24, 0), cfg)
    assert all(r.components["finished"] == [1.0] for r in results)
    assert any(False in env.marks[:-1] for env in played)  # ill-formed, then played on


def test_a_reinforced_episode_leaves_its_ill_formed_replies_out_of_the_loss(tiny):
    """credit.reinforce_ill_formed=False: in an episode with a positive advantage, each
    reply its environment marked ill-formed (`info["format"]` False) leaves the loss
    mask; an episode pushed down keeps all of its replies. Also from a start
    (turns played before the prompt's loss, which the mask does not hold)."""
    from mlx_grpo.credit import withheld_turns
    from mlx_grpo.env import StepResult

    _, _, rollout = _toy_episodes(*tiny)
    # Every other reply is marked ill-formed, whatever its text.
    for i, c in enumerate(rollout.completions):
        ep = c.episode
        ep.results = [
            r._replace(info={"format": (i + k) % 2 == 0}) for k, r in enumerate(ep.results)
        ]
    # One earlier ill-formed turn before a reinforced episode's own (as a start leaves it).
    first = rollout.completions[10].episode  # task 2: three turns
    first.actions.insert(0, "an earlier long reply")
    first.results.insert(0, StepResult("", False, {"format": False}))
    signs = np.where(np.arange(24) % 3 == 0, -1.0, 1.0).astype(np.float32)
    # (fold=False: two alike episodes of a group would share one row's mask, `fold_alike_rows`)
    kept = np.array(build_loss_inputs(rollout, mx.array(signs), 18, False, fold=False).mask)
    cut = build_loss_inputs(
        rollout, mx.array(signs), 18, False, reinforce_ill_formed=False, fold=False
    )
    cut = np.array(cut.mask)
    withheld = reinforced = 0
    for i, c in enumerate(rollout.completions):
        expected = np.zeros(cut.shape[1], np.float32)
        expected[: len(c.tokens)] = c.loss_mask
        replies = _runs(c.loss_mask)
        own = c.episode.actions[len(c.episode.actions) - len(replies) :]
        assert len(own) == len(replies) == c.episode.turns - (i == 10)
        assert kept[i].tolist() == expected.tolist()
        for k, (a, b) in enumerate(replies):
            if signs[i] > 0 and (i + k) % 2:
                expected[a:b] = 0.0
                withheld += 1
            else:
                reinforced += signs[i] > 0
        assert cut[i].tolist() == expected.tolist()
    assert withheld > 0 and reinforced > 0  # both cases occur
    assert len(withheld_turns(rollout.completions, signs)) == withheld
    assert withheld_turns(rollout.completions, -np.abs(signs)) == []
    assert withheld_turns([replace(rollout.completions[1], episode=None)], signs) == []


def test_a_turn_continues_on_the_cache_of_the_previous_one(tiny):
    """`_decode` hands back each sequence's own cache (its start cache, its tail and
    every sampled id): decoding the next turn on it gives the log-probs of one plain
    forward over the whole sequence, for sequences of different lengths in a batch."""
    from mlx_grpo.rollout import _decode, _prefill

    model, tok = tiny
    eos = sorted(tok.eos_token_ids)
    seen: list[mx.array] = []

    def sampler(logprobs):  # greedy, never EOS (the batch keeps its rows), recorded
        seen.append(logprobs)
        return mx.argmax(logprobs - 1e9 * (mx.arange(logprobs.shape[-1]) == eos[0]), axis=-1)

    cfg = RolloutConfig(max_new_tokens=4)
    prompts = [tok.encode("a short prompt"), tok.encode("another, much longer prompt here")]
    caches = [_prefill(model, p) for p in prompts]
    first = _decode(model, tok, [[p[-1]] for p in prompts], caches, cfg, sampler)
    obs = [tok.encode(" then this"), tok.encode(" and then that, observed")]
    seen.clear()
    second = _decode(model, tok, obs, [c for _, _, c, _ in first], cfg, sampler)
    for i, p in enumerate(prompts):
        seq = p + first[i][0] + obs[i] + second[i][0]
        logits = model(mx.array(seq)[None])[0].astype(mx.float32)
        ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        start = len(p) + len(first[i][0]) + len(obs[i]) - 1  # predicts the first new id
        for step in range(cfg.max_new_tokens):
            got = seen[step][i]
            assert mx.allclose(got, ref[start + step], atol=1e-4).item(), (i, step)


def test_turn_limit_ends_episodes_as_length(tiny):
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = [t for t in recipe.tasks("train", 6, 0) if t.payload["turns"] == 3]
    cfg = RolloutConfig(max_new_tokens=4, max_turns=2)
    rollout = rollout_tasks(model, tok, recipe, tasks, 2, cfg)
    for c in rollout.completions:
        assert c.episode.turns == 2 and not c.episode.done and c.finish_reason == "length"
        assert recipe.score(tasks[c.prompt_index], c.episode).components["finished"] == 0.0


def test_multi_turn_recipe_trains_and_logs_episode_figures(tiny_model_dir, tmp_path):
    args = [
        "--recipe",
        str(TOY_ENV),
        f"--model.path={tiny_model_dir}",
        f"--output.dir={tmp_path}",
        "--output.run=e",
        "--train.eval_every=3",
        "--train.eval_tasks=3",
        "--credit.reinforce_ill_formed=false",
    ]
    assert cmd_train(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 1 <= r["episode/turns_mean"] <= 3
        assert "reward/finished" in r and "curriculum/max_level" in r
        # Its replies of 4 characters or more are ill-formed (toy_env), and no more of
        # them can be withheld than the episodes have turns.
        assert 0 <= r["turns/withheld"] <= r["episode/turns_mean"] * 8
    assert "eval/reward" in rows[-1] and "eval/level_1/reward" in rows[-1]
    evals = [json.loads(x) for x in (tmp_path / "e" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3] and len(evals[-1]["results"]) == 3
    assert evals[0]["rollout_tokens"] == 0
    assert evals[-1]["rollout_tokens"] == rows[-1]["rollout/tokens_total"]
    assert (tmp_path / "e" / "adapters.safetensors").exists()


def test_a_full_disk_or_no_memory_in_an_environment_is_not_its_fault():
    import errno

    from mlx_grpo.env import EnvError, env_call

    def raising(e):
        def fn():
            raise e

        return fn

    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as got:
        env_call("env.step()", raising(full))
    assert got.value is full
    with pytest.raises(MemoryError):
        env_call("env.step()", raising(MemoryError()))
    with pytest.raises(EnvError, match=r"^env.step\(\) raised ValueError: bad$"):
        env_call("env.step()", raising(ValueError("bad\nmore")))


BROKEN = {
    "reset": "def reset(self):\n        raise ConnectionError('the page server is down\\nmore')",
    "step": "def step(self, action):\n        raise KeyError('turn')",
}


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_that_raises_stops_the_run_in_one_line(
    tiny_model_dir, tmp_path, capsys, where
):
    """A recipe's environment whose reset or step raises: one line naming the recipe,
    the task and the exception, and the checkpoints already saved are kept."""
    import shutil

    from mlx_grpo.cli import main

    recipe = tmp_path / "broken_env"
    shutil.copytree(TOY_ENV, recipe)
    code = (recipe / "tasks.py").read_text()
    code = code.replace(
        "def make_env(task):",
        f"class Broken(CountEnv):\n    {BROKEN[where]}\n\n\ndef make_env(task):\n"
        "    if BREAK[0]:\n        return Broken(task.payload['turns'])\n",
    )
    (recipe / "tasks.py").write_text(code + "\nimport os\nBREAK = [os.environ.get('BREAK')]\n")
    args = ["train", "--recipe", str(recipe), f"--model.path={tiny_model_dir}",
            f"--output.dir={tmp_path}", "--output.run=r", "--train.eval_every=0"]  # fmt: skip
    assert cmd_train([*args[1:], "--train.steps=1"]) == 0
    import os

    os.environ["BREAK"] = "1"
    try:
        with pytest.raises(SystemExit) as done:
            main([*args, "--train.steps=2", "--resume", str(tmp_path / "r")])
    finally:
        del os.environ["BREAK"]
    err = capsys.readouterr().err
    said = {"reset": "env.reset() raised ConnectionError: the page server is down",
            "step": "env.step() raised KeyError: 'turn'"}[where]  # fmt: skip
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: recipe {recipe}: task train-") and said in err, err
    assert err.rstrip().endswith("continue from the last checkpoint with --resume")
    assert (tmp_path / "r" / "step-000001").is_dir()


def test_a_run_that_ends_episodes_at_ill_formed_replies_logs_how_many(tiny_model_dir, tmp_path):
    """Every reply of this seeded run is 4 characters or more (the tiny model rarely
    draws its EOS early), so ill-formed for toy_env: under rollout.end_on_ill_formed
    every episode is one reply long, and those of tasks with more turns are the ones
    the rule ended."""
    args = [
        "--recipe",
        str(TOY_ENV),
        f"--model.path={tiny_model_dir}",
        f"--output.dir={tmp_path}",
        "--output.run=c",
        "--rollout.end_on_ill_formed=true",
        "--train.sample_every=1",
    ]
    assert cmd_train(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (tmp_path / "c" / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["episode/turns_mean"] == 1.0
        mine = [s for s in samples if s["step"] == r["step"]]
        assert len(mine) == 8
        # Tasks are "train-0-i", lasting 1 + i % 3 turns.
        longer = [int(s["task"].rsplit("-", 1)[1]) % 3 > 0 for s in mine]
        assert r["episodes/ended_ill_formed"] == np.mean(longer)
        assert all(
            s["finish_reason"] == ("ill_formed" if lg else "stop") for s, lg in zip(mine, longer)
        )
    assert any(r["episodes/ended_ill_formed"] > 0 for r in rows)


def test_plot_writes_a_png_of_a_multi_turn_run(tiny_model_dir, tmp_path, capsys):
    from mlx_grpo.cli import cmd_plot

    args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}", f"--output.dir={tmp_path}"]
    assert cmd_train([*args, "--output.run=p", "--train.eval_every=2", "--train.eval_tasks=2"]) == 0
    assert cmd_plot([str(tmp_path / "p")]) == 0
    png = (tmp_path / "p" / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert cmd_plot([str(tmp_path / "nothing")]) == 2
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert cmd_plot([str(tmp_path / "p"), "--out", str(tmp_path / "file" / "m.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out: cannot write {tmp_path / 'file' / 'm.png'} (Not a directory)\n"
    assert cmd_plot([str(tmp_path / "p"), "--out", str(tmp_path / "m.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out: {tmp_path / 'm.jsonl'}: Format")
    with pytest.raises(SystemExit):
        cmd_plot([str(tmp_path / "p"), "--smooth", "0"])
    assert capsys.readouterr().err.count("\n") == 1


def test_the_plot_draws_kl_and_both_entropies_from_the_log(tmp_path, monkeypatch):
    """The KL panel has one line per logged series, with the logged values (smoothing
    off), and leaves out what a run did not log."""
    import matplotlib.figure

    from mlx_grpo.plot import plot_run
    from mlx_grpo.runfolder import RunFolder

    rows = [{"step": i + 1, "reward/mean": 0.1 * i, "kl": 0.01 * i, "entropy/sampled": 0.5 + i}
            for i in range(4)]  # fmt: skip
    rows[2]["entropy"] = 0.25  # one step that trained
    rows[3]["entropy"] = "n/a"  # hand-edited lines: a value that is not a number, no step
    rows.append({"kl": 9.0})
    RunFolder(tmp_path).metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_run(tmp_path, smooth=1)
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
             for ln in saved[0].axes[2].get_lines()}  # fmt: skip
    assert lines == {
        "KL to reference": ([1, 2, 3, 4], [0.0, 0.01, 0.02, 0.03]),
        "entropy of the update's tokens": ([3], [0.25]),
        "entropy of every sampled token": ([1, 2, 3, 4], [0.5, 1.5, 2.5, 3.5]),
    }


def test_a_reply_ends_at_its_first_line_break_under_stop_at_newline(tiny):
    """The sampler alternates 'A' and a line break: with `stop_at_newline` every turn
    stops at its first break (kept in the tokens, the env sees the line before it, the
    template closes the turn after it), without it the turn runs to the length limit
    and the env sees every line."""
    model, tok = tiny
    newline = tok.encode("A\n")[-1]
    assert tok.decode([newline]) == "\n"
    script = [tok.encode("A")[-1], newline]
    calls = {"n": 0}

    def alternate(logprobs):
        calls["n"] += 1
        return mx.full((logprobs.shape[0],), script[calls["n"] % 2], dtype=mx.uint32)

    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = [t for t in recipe.tasks("train", 6, 0) if t.payload["turns"] == 3][:1]
    cfg = RolloutConfig(max_new_tokens=6, max_turns=3, stop_at_newline=True)
    rollout = rollout_tasks(model, tok, recipe, tasks, 1, cfg, sampler=alternate)
    (c,) = rollout.completions
    replies = [c.tokens[a:b] for a, b in _runs(c.loss_mask)]
    assert len(replies) == 3 and c.finish_reason == "stop"
    for reply, action in zip(replies, c.episode.actions):
        assert reply[-1] == newline and newline not in reply[:-1]
        assert action == tok.decode(reply[:-1]) and "\n" not in action
    conv = recipe.first_messages(tasks[0], recipe.make_env(tasks[0]))
    for reply, result in zip(replies[:-1], c.episode.results):
        conv += [
            {"role": "assistant", "content": _raw(tok, reply)},
            {"role": "user", "content": result.observation},
        ]
    expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert _raw(tok, rollout.prompts[0] + c.tokens) == expected + _raw(tok, replies[-1])

    cfg = cfg.model_copy(update={"stop_at_newline": False})
    (c,) = rollout_tasks(model, tok, recipe, tasks, 1, cfg, sampler=alternate).completions
    assert len(c.episode.actions) == 3
    assert all(a.count("\n") == 3 for a in c.episode.actions)


def test_a_step_beyond_max_in_flight_plays_in_batches_of_whole_groups(tiny, monkeypatch):
    """Six tasks of four episodes with at most eight in flight: three batches of two
    whole groups, never more than eight episodes at once, and with per-episode keys
    the same episodes, in the same order and owners, as all 24 in one batch."""
    import mlx_grpo.rollout as rollout_mod
    from mlx_grpo.rollout import keyed_samplers

    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("train", 6, 0)
    cfg = RolloutConfig(max_new_tokens=6, max_turns=3, temperature=1.0)
    keys = mx.random.split(mx.random.key(5), 24)
    whole = rollout_tasks(model, tok, recipe, tasks, 4, cfg, keyed_samplers(cfg, keys))

    in_flight = []
    play = rollout_mod.play_episodes

    def counted(model, tokenizer, prompts, envs, *args, **kw):
        in_flight.append(len(envs))
        return play(model, tokenizer, prompts, envs, *args, **kw)

    monkeypatch.setattr(rollout_mod, "play_episodes", counted)
    small = cfg.model_copy(update={"max_in_flight": 8})
    parts = rollout_tasks(model, tok, recipe, tasks, 4, small, keyed_samplers(small, keys))
    assert in_flight == [8, 8, 8]
    assert len(parts.prompts) == 6 and parts.prompts == whole.prompts
    assert [c.prompt_index for c in parts.completions] == [i // 4 for i in range(24)]
    assert [c.tokens for c in parts.completions] == [c.tokens for c in whole.completions]
    assert [c.episode.actions for c in parts.completions] == [
        c.episode.actions for c in whole.completions
    ]
    assert len({tuple(c.tokens) for c in whole.completions}) > 12  # temperature samples


@pytest.mark.parametrize("compile_decode", [False, True])
def test_episodes_that_played_alike_share_their_tail_prefill(tiny, monkeypatch, compile_decode):
    """Within a group, two episodes drawn from the same key play the same turns: their
    environment's answers are prefilled once (share_tails). The episodes are the ones
    played with every tail prefilled per episode, token for token, and the model
    processes at least the saved tokens fewer."""
    import mlx_grpo.rollout as rollout_mod
    from mlx_grpo.rollout import keyed_samplers

    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = [t for t in recipe.tasks("train", 6, 0) if t.payload["turns"] == 3]
    cfg = RolloutConfig(
        max_new_tokens=3, max_turns=3, temperature=1.0, compile_decode=compile_decode
    )
    keys = mx.random.split(mx.random.key(3), 4 * len(tasks))
    keys = mx.concatenate([keys[:1], keys[:1], keys[2:]])  # episodes 0 and 1: one key

    fed = []
    forward = type(model).__call__

    def counted(self, inputs, *args, **kw):
        fed.append(inputs.size)
        return forward(self, inputs, *args, **kw)

    monkeypatch.setattr(type(model), "__call__", counted)
    shared = rollout_tasks(model, tok, recipe, tasks, 4, cfg, keyed_samplers(cfg, keys))
    fed_shared = sum(fed)
    fed.clear()
    monkeypatch.setattr(rollout_mod, "share_tails", lambda *a: 0)
    each = rollout_tasks(model, tok, recipe, tasks, 4, cfg, keyed_samplers(cfg, keys))
    assert each.shared_tail_tokens == 0
    # Episodes 0 and 1 play all three turns alike: two answers of several tokens shared.
    assert shared.completions[0].tokens == shared.completions[1].tokens
    assert shared.completions[0].episode.turns == 3
    assert shared.shared_tail_tokens >= 2 * 2
    assert [c.tokens for c in shared.completions] == [c.tokens for c in each.completions]
    assert [c.loss_mask for c in shared.completions] == [c.loss_mask for c in each.completions]
    if not compile_decode:  # (a compiled step calls the model only while tracing)
        assert sum(fed) - fed_shared >= shared.shared_tail_tokens


def test_a_below_average_episode_keeps_only_the_replies_an_above_average_one_was_there_for(
    tiny,
):
    """credit.blame_replies="compared": a reply of an episode with a negative advantage
    stays in the loss only if an episode of its group with a positive advantage made the
    same earlier moves and played on from there, or if its environment marked it
    ill-formed (wrong whatever a better episode did); the reference here reads the
    episodes' actions and the toy's format rule (a reply of 4 characters or more), not
    their tokens. Episodes with a positive advantage keep every reply."""
    import copy

    from mlx_grpo.credit import uncompared_turns

    _, _, rollout = _toy_episodes(*tiny)
    comps = rollout.completions
    # Task 2 (three turns): row 9 makes row 8's first two moves, then another last one.
    twin = copy.deepcopy(comps[8])
    a, b = _runs(twin.loss_mask)[-1]
    twin.tokens[a] = (twin.tokens[a] + 1) % 200
    twin.episode.actions[-1] += " otherwise"
    comps[9] = twin
    # The tiny model's replies are long (ill-formed in the toy): every other episode's
    # are marked well-formed, so that both kinds of reply meet the rule.
    for c in comps[1::2]:
        c.episode.results = [r._replace(info={**r.info, "format": True}) for r in c.episode.results]
    signs = np.where(np.arange(24) % 4 == 0, 1.0, -1.0).astype(np.float32)  # 4k up
    kept = np.array(build_loss_inputs(rollout, mx.array(signs), 18, False).mask)
    cut = np.array(
        build_loss_inputs(rollout, mx.array(signs), 18, False, blame_replies="compared").mask
    )
    left_out = kept_ill_formed = 0
    for i, c in enumerate(comps):
        expected = kept[i].copy()
        ups = [comps[j].episode.actions for j in range(i - i % 4, i - i % 4 + 4) if signs[j] > 0]
        acts = c.episode.actions
        for k, (lo, hi) in enumerate(_runs(c.loss_mask)):
            seen = any(u[:k] == acts[:k] and len(u) > k for u in ups)
            if signs[i] < 0 and not seen:
                if c.episode.results[k].info["format"] is False:  # blamed all the same
                    kept_ill_formed += 1
                else:
                    expected[lo:hi] = 0.0
                    left_out += 1
        assert cut[i].tolist() == expected.tolist(), i
    assert left_out == len(uncompared_turns(comps, signs, 4)) > 0
    assert kept_ill_formed > 0
    assert cut[9].tolist() == kept[9].tolist()  # the twin keeps all three replies
    assert any(c.episode.turns > 1 and signs[i] < 0 for i, c in enumerate(comps))
