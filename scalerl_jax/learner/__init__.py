"""The learner: optimizer, jitted sharded train step with exact micro-batch accumulation, metrics.
See docs/LEARNER.md."""
from scalerl_jax.learner.batch import RLSpec, prepare, split_microbatches, validate_batch
from scalerl_jax.learner.learner import Learner, jit_train_step, state_shardings
from scalerl_jax.learner.logprobs import token_logprobs
from scalerl_jax.learner.optimizer import make_optimizer, warmup_constant_schedule
from scalerl_jax.learner.state import LearnerState
from scalerl_jax.learner.train_step import make_train_step

__all__ = ["Learner", "LearnerState", "RLSpec", "jit_train_step", "make_optimizer",
           "make_train_step", "prepare", "split_microbatches", "state_shardings",
           "token_logprobs", "validate_batch", "warmup_constant_schedule"]
