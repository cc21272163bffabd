"""Types shared by every process of a run (no JAX): prompts, completions, sampling settings.

The learner, the buffer, the generators and the data loaders all speak these; keeping them here (and
not in any one process's package) is what lets dependencies point one way.
"""
from __future__ import annotations

import dataclasses

import numpy as np

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_INTERRUPTED = "interrupted"


@dataclasses.dataclass(frozen=True)
class PromptSpec:
  """One prompt to sample from. `answer` is the verifier's reference (never shown to the model);
  `task` names its task in a mixture (config.data.mixture; "" for a one-task dataset)."""
  prompt_id: int
  tokens: np.ndarray          # int32 [P]
  answer: str = ""
  task: str = ""


@dataclasses.dataclass
class Completion:
  """One sampled completion; all per-token arrays have the completion's length L."""
  prompt_id: int
  tokens: np.ndarray          # int32 [L]
  logprobs: np.ndarray        # float32 [L], generator log-prob of each token (0 for injected tokens)
  versions: np.ndarray        # int32 [L], policy version that produced each token
  policy_mask: np.ndarray     # bool [L], False for injected (interruption) tokens
  finish_reason: str          # FINISH_STOP | FINISH_LENGTH | FINISH_INTERRUPTED
  reward: float = 0.0
  # MoE routing replay (optional): int32 [P+L, R, K], the experts each prompt and completion token
  # was routed to in each of the R MoE layers (K per token).
  routes: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Sampling and length-control settings (forced interruption, PAPER_NOTES §3)."""
  temperature: float = 1.0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  think_budget_min: int = 10240
  think_budget_max: int = 12288
  answer_budget: int = 2048
  think_end_tokens: tuple[int, ...] = ()     # e.g. tokens of "</think>"; ends thinking naturally
  # Text mode of the end-of-thinking rule (generation/interruption.py): thinking ends once the
  # decoded completion contains think_end_text; think_end_vocab = (id, text) of the tokens that
  # can write it (interruption.think_end_vocab). Empty: exact id sequence think_end_tokens.
  think_end_text: str = ""
  think_end_vocab: tuple[tuple[int, str], ...] = ()
  interruption_tokens: tuple[int, ...] = ()  # injected when the thinking budget is exhausted
  seed: int = 0


class WeightUpdateError(IOError):
  """A weight version that must not be installed: `version`, `name` (the tensor, "" when the whole
  version is at fault) and `cause`, e.g. a checksum mismatch, a wrong shape or an unknown name."""

  def __init__(self, version: int, name: str, cause: str):
    self.version, self.name, self.cause = int(version), str(name), str(cause)
    super().__init__(self.line())

  def line(self) -> str:
    """One line: version, weight name, cause."""
    return (f"weight update to version {self.version} failed at "
            f"{self.name or '(whole version)'}: {self.cause}")


def one_line(e: BaseException, limit: int = 300) -> str:
  """An exception as "Type: first line of its message" (at most `limit` characters)."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:limit] if lines else ''}"


# The x-axes a scaling curve is fitted on (`forecast.axis`, analysis/metrics.py): compute as
# logged (`compute_hours`) or the learner step. Here, below the config layer and analysis/, so
# that scalerl_jax/config/ checks the knob without importing analysis/ (docs/ARCHITECTURE.md "Layers").
FORECAST_AXES = ("compute", "step")
