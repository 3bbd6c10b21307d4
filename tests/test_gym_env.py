"""gymnasium environments through the adapter: text ones as they are, others with an
observe/act pair; rewards summed into the episode's reward; a task's episodes start
alike; an invalid action is answered, not played; and a recipe file's gymnasium env
plays through the trainer's rollout."""

from __future__ import annotations

import re
import textwrap

import mlx.core as mx
import pytest

gymnasium = pytest.importorskip(
    "gymnasium", reason="gymnasium is not installed (the miniwob dependency brings it)"
)
from conftest import recipe_folder  # noqa: E402
from gymnasium import spaces  # noqa: E402

from mlx_grpo.config import RolloutConfig  # noqa: E402
from mlx_grpo.env import Episode, env_call  # noqa: E402
from mlx_grpo.gym_env import GymEnv, gym_env, gym_return  # noqa: E402
from mlx_grpo.recipe import Recipe, Task  # noqa: E402

GUESS_ENV = '''
import string

import gymnasium
from gymnasium import spaces


class GuessEnv(gymnasium.Env):
    """Guess a number from 0 to 9; the answer says higher or lower. +1 and done when
    right, -0.1 for each wrong guess, truncated after four guesses."""

    def __init__(self):
        self.observation_space = spaces.Text(64, charset=string.printable)
        self.action_space = spaces.Text(1, charset="0123456789")

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.secret, self.guesses = int(self.np_random.integers(10)), 0
        return "Guess a number from 0 to 9.", {}

    def step(self, action):
        guess = int(action)
        self.guesses += 1
        if guess == self.secret:
            return "right", 1.0, True, False, {}
        hint = "higher" if guess < self.secret else "lower"
        return hint, -0.1, False, self.guesses >= 4, {}
'''
_ns: dict = {}
exec(GUESS_ENV, _ns)  # noqa: S102 - the same text the recipe test writes to a file
GuessEnv = _ns["GuessEnv"]


def _task(i: int) -> Task:
    return Task(f"train-0-{i}", 1, [{"role": "user", "content": "Play."}])


def _bisect(env: GymEnv, max_turns: int = 8) -> Episode:
    """A scripted policy: halve the range after each hint."""
    episode, lo, hi = Episode(env=env), 0, 9
    env.reset()
    for _ in range(max_turns):
        guess = (lo + hi) // 2
        result = env.step(f" {guess}\n")
        episode.actions.append(str(guess))
        episode.results.append(result)
        if result.done:
            episode.done = True
            break
        lo, hi = (guess + 1, hi) if result.observation == "higher" else (lo, guess - 1)
    return episode


def test_a_text_env_runs_through_the_adapter_with_its_rewards_summed():
    make_env = gym_env(lambda task: GuessEnv())
    for i in range(6):
        env = make_env(_task(i))
        episode = _bisect(env)
        # bisection finds any of ten numbers within the four guesses allowed
        assert episode.done and episode.results[-1].info["terminated"]
        assert env.env.secret == int(episode.actions[-1])
        assert env.rewards == [-0.1] * (episode.turns - 1) + [1.0]
        assert gym_return(_task(i), episode) == {"return": pytest.approx(sum(env.rewards))}


def test_a_tasks_episodes_start_alike_and_tasks_differ():
    make_env = gym_env(lambda task: GuessEnv())
    secrets = []
    for i in range(8):
        group = [make_env(_task(i)) for _ in range(4)]
        for env in group:
            env.reset()
        assert len({env.env.secret for env in group}) == 1
        secrets.append(group[0].env.secret)
    assert len(set(secrets)) > 1


def test_an_invalid_action_is_answered_and_not_played():
    env = gym_env(lambda task: GuessEnv())(_task(0))
    env.reset()
    result = env.step("I think it is five")
    assert result.observation.startswith("invalid action: 'I think it is five' is not in")
    assert not result.done and result.info["format"] is False
    assert env.env.guesses == 0 and env.invalid_actions == 1 and env.rewards == []


class Countdown(gymnasium.Env):
    """A number observation and a discrete action: subtract 1 or 2; reaching 0 wins."""

    def __init__(self):
        self.observation_space = spaces.Discrete(8)
        self.action_space = spaces.Discrete(3)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.n = (options or {}).get("start", 5)
        return self.n, {}

    def step(self, action):
        self.n = max(self.n - int(action), 0)
        return self.n, float(self.n == 0), self.n == 0, False, {}


def test_observe_and_act_adapt_an_env_without_text():
    make_env = gym_env(
        lambda task: Countdown(), observe=lambda n: f"{n} left", act=lambda text: int(text)
    )
    task = Task("t", 1, [], {"options": {"start": 3}})
    env = make_env(task)
    assert env.reset() == "3 left"
    assert env.step("two").observation.startswith("invalid action: invalid literal for int()")
    assert env.step("5").observation == "invalid action: 5 is not in the action space Discrete(3)"
    assert env.step("2").observation == "1 left"
    assert env.step("1").done and env.total == 1.0
    # without `observe`, a number is no observation: one line saying what to pass
    bare = gym_env(lambda task: Countdown())(task)
    with pytest.raises(Exception, match=r"^reset\(\) raised TypeError: gym_env: .*observe=") as e:
        env_call("reset()", bare.reset)
    assert "\n" not in str(e.value)


def test_a_registered_id_is_made_with_gymnasium_make():
    gymnasium.register("mlx-grpo-test/Guess-v0", entry_point=GuessEnv)
    env = gym_env("mlx-grpo-test/Guess-v0")(_task(1))
    assert env.reset() == "Guess a number from 0 to 9."
    assert _bisect(env).done
    env.close()


RECIPE = GUESS_ENV + textwrap.dedent(
    """
    from mlx_grpo.gym_env import gym_env, gym_return
    from mlx_grpo.recipe import Task


    def make_tasks(split, n, seed):
        return [Task(f"{split}-{seed}-{i}", 1, [{"role": "user", "content": "Play."}])
                for i in range(n)]


    make_env = gym_env(lambda task: GuessEnv())
    reward = gym_return
    """
)


def test_a_recipe_files_gym_env_plays_through_the_trainers_rollout(tiny, tmp_path):
    """The tiny model, its every token scripted to '5' with one token a turn, plays the
    guessing game for three turns: the reward is the environment's rewards summed. Its
    prompts are the template's of its first messages, as before tools were rendered."""
    model, tok = tiny
    folder = recipe_folder(tmp_path, "guess", RECIPE)
    recipe = Recipe(str(folder), {"return": 1.0}, {})
    tasks = recipe.tasks("train", 3, 0)
    five = tok.encode("5", add_special_tokens=False)[0]

    def always_five(logprobs):
        return mx.full((logprobs.shape[0],), five, dtype=mx.uint32)

    from mlx_grpo.rollout import rollout_tasks

    cfg = RolloutConfig(max_new_tokens=1, max_turns=3)
    rollout = rollout_tasks(model, tok, recipe, tasks, 2, cfg, sampler=always_five)
    for task, prompt in zip(tasks, rollout.prompts):  # no tools: the template's prompt alone
        first = recipe.first_messages(task, recipe.make_env(task))
        assert prompt == list(tok.apply_chat_template(first, add_generation_prompt=True))
    assert rollout.tool_stats == []
    scored = recipe.score_rollout(tasks, rollout)
    for c, s in zip(rollout.completions, scored):
        env = recipe.make_env(tasks[c.prompt_index])
        env.reset()
        expected = 1.0 if env.env.secret == 5 else -0.3
        assert c.episode.actions == ["5"] * (1 if expected == 1.0 else 3)
        assert s.reward == pytest.approx(expected) and s.components["return"] == s.reward
        hints = [r.observation for r in c.episode.results[:-1]]
        assert all(re.fullmatch("higher|lower", h) for h in hints)
