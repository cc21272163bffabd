# Type stub: the part of ml_collections.config_flags the project uses (see ../__init__.pyi).
from typing import Any

from absl import flags
from ml_collections import ConfigDict

def DEFINE_config_file(name: str, default: str | None = ..., help_string: str = ...,
                       flag_values: flags.FlagValues = ..., lock_config: bool = ..., accept_new_attributes: bool = ...,
                       sys_argv: list[str] | None = ..., **kwargs: Any) -> flags.FlagHolder[ConfigDict]: ...
def DEFINE_config_dict(name: str, config: ConfigDict, help_string: str = ...,
                       flag_values: flags.FlagValues = ..., lock_config: bool = ..., **kwargs: Any
                       ) -> flags.FlagHolder[ConfigDict]: ...
