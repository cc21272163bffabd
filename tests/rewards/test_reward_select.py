"""A reward is chosen by a config key (`data.reward`, `data.tasks.NAME.reward`), defaulting to the
data kind's; a new reward is one registered function (its module plus one import), and whether it
runs model code is said at its registration."""
import pytest

from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import recipes, rewards
from scalerl_jax.data import REWARD_FOR_KIND, build_dataset

NAME = "test_always_one"
if NAME not in rewards.names():
  @rewards.register(NAME)
  def _always_one(text: str, answer: str) -> float:
    return 1.0


def _data(**kw):
  c = tiny.get_config()
  c.data.update(kw)
  return c


def test_default_is_the_kinds_and_the_key_selects_another():
  c = _data()
  assert c.data.reward == "" and build_dataset(c.data, c.rollout.max_prompt_len).task_rewards == {
      "": REWARD_FOR_KIND["synthetic"]}
  c = _data(reward=NAME)
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  assert ds.task_rewards == {"": NAME} and not ds.needs_sandbox
  p = ds.heldout[0]
  assert ds.grade([1, 2, 3], p.answer).reward == 1.0           # every completion "passes"
  assert _data().data.reward == ""                               # nothing leaked into the default


def test_unknown_reward_is_refused_at_start_with_the_registered_names():
  c = _data(reward="no_such_reward")
  with pytest.raises(recipes.ConfigError, match=r"data.reward='no_such_reward'; registered rewards: \[.*'math'"):
    recipes.check_data(c.data)
  c = tiny.get_config()
  c.data.tasks.code = common.task_section("tiny_code", reward="nope")
  c.data.tasks.math = common.task_section("synthetic")
  c.data.mixture = "code:0.5,math:0.5"
  with pytest.raises(recipes.ConfigError, match=r"data.tasks.code: config.data.reward='nope'"):
    recipes.check_data(c.data)


def test_sandboxing_is_declared_at_registration():
  assert rewards.is_sandboxed("code") and rewards.is_sandboxed("tiny_code")
  assert not rewards.is_sandboxed("math") and not rewards.is_sandboxed(NAME)
  with pytest.raises(ValueError, match="registered"):
    rewards.is_sandboxed("no_such_reward")
