"""The typed config machinery: `Section` (frozen, keyword-only, each value checked against its
field's type on construction, then the section's `check()`), `ConfigError` (one actionable line),
THE logical-axis rules table and the value sets the sections check against.

Imports neither JAX nor ml_collections (a ConfigDict is recognised by its type's name): every
process, the JAX-free buffer included, builds its run config with it.
"""

import collections.abc
import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, ClassVar, Mapping


# THE logical-axis rules table. Model code only names logical axes; this maps them to mesh axes.
# A logical axis mapped to None is replicated. Order of mesh axes in a tuple matters (major first).
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),  # the expert axis also splits tokens (non-MoE parts)
    ("seq", None),
    ("act_seq", None),        # the residual stream's (and remat's saved layer inputs') sequence dim
    ("embed", ("fsdp", "expert")),  # parameter d_model dimension (FSDP over fsdp x expert)
    ("act_embed", None),      # activation d_model dimension (residual stream)
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("expert", "expert"),     # routed-expert kernels' expert dimension (expert parallelism)
    ("act_expert", "expert"),
    ("expert_embed", "fsdp"),  # routed-expert kernels' d_model dimension
    ("expert_mlp", "tensor"),  # routed-expert kernels' ffn dimension
    ("layers", None),         # the scanned-layers axis
    ("norm", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
)


class ConfigError(ValueError):
  """A bad run configuration; the message is one actionable line."""


class PresetError(ConfigError):
  """A preset file or a `--config.a.b=value` override that cannot be read (an unknown knob, a
  value not of the knob's type): a bad command line (main exits with status 2)."""


WIRE_DTYPES = ("bfloat16", "float32")   # weights.wire_dtype values (config.wire_dtype)
VERIFY_MODES = ("metadata", "full")      # checkpoint.verify values (training/checkpoint.py)
RESUME_MODES = ("auto", "never")         # resume values (training/job.py)
# health.abort_on signal names (training/health.py).
HEALTH_SIGNALS = ("length_cut_frac", "truncated_frac", "kl", "entropy", "skipped", "parity",
                  "grade_fail")
# Config parts whose keys are free-form (not declared below): ModelConfig field overrides in
# `model` (checked against ModelConfig by Model), extra vLLM kwargs, named task sections.
FREE_FORM = ("model", "generator.vllm_args", "data.tasks")


# ---------------------------------------------------------------------------------------------
# Typed sections. Each field is one knob: its type, its default (the only one) and its comment.
# `base_config()` builds the ml_collections ConfigDict from these defaults (what config files and
# `--config.a.b=value` override); `RunConfig.from_config(config)` builds the typed, frozen run
# config back from it, checking each value's type and each section's values (ConfigError).
# ---------------------------------------------------------------------------------------------
def _type_name(hint) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _typed(where: str, value, hint):
  """`value` checked against the annotation `hint` (an int is accepted for a float; a list for a
  tuple; a ConfigDict for a Mapping or a section), normalised; ConfigError naming `where`."""
  if hint is Any:
    return value
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for h in args:
      if h is type(None):
        continue
      try:
        return _typed(where, value, h)
      except ConfigError as e:
        errors.append(e)
    raise errors[0]
  if isinstance(hint, type) and issubclass(hint, Section):
    if isinstance(value, hint):
      return value
    if is_node(value):
      return hint.from_config(value, where)
  elif origin is tuple:
    if isinstance(value, (tuple, list)):
      if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_typed(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value))
      if not args or len(args) == len(value):
        return tuple(value) if not args else tuple(
            _typed(f"{where}[{i}]", v, h) for i, (v, h) in enumerate(zip(value, args)))
  elif origin in (Mapping, collections.abc.Mapping, dict) or hint in (Mapping, dict):
    if _is_configdict(value):
      value = value.to_dict() if not (args and is_section(args[1])) else dict(value.items())
    if isinstance(value, Mapping):
      if args and is_section(args[1]):
        return {k: _typed(f"{where}.{k}", v, args[1]) for k, v in value.items()}
      return dict(value)
  elif hint is bool:
    if isinstance(value, bool):
      return value
  elif hint is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif isinstance(hint, type):
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
      return value
  else:
    return value
  raise ConfigError(f"{where}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def _is_configdict(value) -> bool:
  """An ml_collections ConfigDict, told apart without importing ml_collections (this layer does not)."""
  return type(value).__name__ in ("ConfigDict", "FrozenConfigDict") and hasattr(value, "to_dict")


def is_node(value) -> bool:
  """A mapping or a ConfigDict: what a section is built from."""
  return isinstance(value, Mapping) or _is_configdict(value)


def is_section(hint) -> bool:
  return isinstance(hint, type) and issubclass(hint, Section)


@functools.cache
def field_hints(cls) -> dict:
  """A section class's field annotations, resolved (once per class)."""
  return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
  """Base of the typed sections: frozen, keyword-only, type-checked and validated on construction
  (`check()`: the section's own value checks, one ConfigError line each)."""
  PATH: ClassVar[str] = ""

  def __post_init__(self):
    hints = field_hints(type(self))
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      typed = _typed(f"{self.PATH}.{f.name}".lstrip("."), value, hints[f.name])
      if typed is not value:
        object.__setattr__(self, f.name, typed)
    self.check()

  def check(self) -> None:
    """The section's own value checks (override); cross-section checks live in RunConfig."""

  @classmethod
  def from_config(cls, node, where: str | None = None):
    """This section from a ConfigDict (or mapping) node: every key declared (else ConfigError),
    every value of its field's type; keys the node lacks keep their defaults."""
    where = cls.PATH if where is None else where
    hints = field_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    keys = list(node.keys())
    extra = [k for k in keys if k not in names]
    kwargs = cls.extra_keys(node, extra, where) if extra else {}
    for k in keys:
      if k in names:
        kwargs[k] = _typed(f"{where}.{k}".lstrip("."), node[k], hints[k])
    return cls(**kwargs)

  @classmethod
  def extra_keys(cls, node, extra: list, where: str) -> dict:
    """Keys of the node that are not fields: an error (sections with free-form keys override)."""
    names = [f.name for f in dataclasses.fields(cls)]
    near = difflib.get_close_matches(extra[0], names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"{where}.{extra[0]}: undeclared config key{hint} (declared: "
                      f"{', '.join(names)})".lstrip("."))

  def to_dict(self) -> dict:
    """The section as plain data (nested sections as dicts), as ConfigDict.to_dict."""
    return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)
            if f.metadata.get("key", True)}


def plain(x):
  if isinstance(x, Section):
    return x.to_dict()
  if isinstance(x, Mapping):
    return {k: plain(v) for k, v in x.items()}
  return x


def section_field(cls):
  """A section field whose default is the section's defaults."""
  return dataclasses.field(default_factory=cls)


