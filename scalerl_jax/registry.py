"""One registry helper for everything chosen by name in a config (losses, aggregations, advantage
normalisations, rollout-correction switches, rewards, generator backends, model families, launch
backends).

  LOSSES = Registry("loss")
  @LOSSES.register("cispo")
  def cispo(...): ...
  LOSSES.get("cispo")        # unknown names raise ValueError listing the registered ones
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """Name -> object table; a name registers once, and lookups of unknown names say what exists."""

  def __init__(self, kind: str):
    self.kind = kind
    self._items: dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: adds the decorated object under `name` (a second registration is an error)."""
    def deco(obj: T) -> T:
      if name in self._items:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._items[name] = obj
      return obj
    return deco

  def get(self, name: str) -> T:
    """The object registered as `name`; ValueError naming the registered ones otherwise."""
    try:
      return self._items[name]
    except KeyError:
      raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}") from None

  def names(self) -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(self._items))

  def __contains__(self, name: str) -> bool:
    return name in self._items

  def __iter__(self) -> Iterator[str]:
    """Names in registration order (the order composed pieces are applied in)."""
    return iter(tuple(self._items))

  def items(self) -> tuple[tuple[str, T], ...]:
    """(name, object) pairs in registration order."""
    return tuple(self._items.items())

  def __repr__(self) -> str:
    return repr(tuple(self._items))
