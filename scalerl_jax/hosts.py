"""Host-name overrides: the one address-override mechanism (`$SCALERL_HOSTS`), read where the code
binds or dials an address (protocol/rpc.add_port / open_channel, distributed.initialize).

  SCALERL_HOSTS="scalerl-buffer.default.svc.cluster.local=127.0.0.1,0.0.0.0=127.0.0.2"

maps each NAME to ADDRESS, like an /etc/hosts line, before the address is used. A wildcard entry
(`0.0.0.0=IP`) makes a server that binds all interfaces bind IP instead: how `launch.rehearse` gives
each rehearsed pod its own loopback address (two learner pods both listen on port 50052, as two pods
on a cluster do). Unset (every cluster run), addresses are used as given. No dependencies (JAX-free
processes import it).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

ENV = "SCALERL_HOSTS"
WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def table(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
  """{name: address} from $SCALERL_HOSTS ("name=addr,name=addr"; blanks ignored)."""
  raw = (os.environ if env is None else env).get(ENV, "")
  out = {}
  for item in raw.replace(";", ",").split(","):
    item = item.strip()
    if not item:
      continue
    name, sep, addr = item.partition("=")
    if not sep or not name.strip() or not addr.strip():
      raise ValueError(f"${ENV}: {item!r} is not NAME=ADDRESS")
    out[name.strip()] = addr.strip()
  return out


def split(address: str) -> tuple[str, str]:
  """'host:port' / '[v6]:port' -> (host, port); port '' when absent."""
  if address.startswith("["):
    host, _, rest = address[1:].partition("]")
    return host, rest[1:] if rest.startswith(":") else ""
  if address.count(":") == 1:
    host, _, port = address.partition(":")
    return host, port
  return address, ""


def resolve_host(host: str, env: Optional[Mapping[str, str]] = None) -> str:
  """`host` after the override table (a wildcard maps through its `0.0.0.0` entry)."""
  t = table(env)
  if not t:
    return host
  if host in WILDCARDS:
    return t.get("0.0.0.0", host)
  return t.get(host, host)


def resolve(address: str, env: Optional[Mapping[str, str]] = None) -> str:
  """'host:port' with its host overridden (unchanged when the table has no entry)."""
  host, port = split(address)
  new = resolve_host(host, env)
  if new == host:
    return address
  if ":" in new and not new.startswith("["):
    new = f"[{new}]"
  return f"{new}:{port}" if port else new
