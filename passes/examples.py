"""The built-in decoder factory and quantizers the main job uses (:mod:`passes.flow.examples`)."""

from .flow.examples import *  # noqa: F403
from .flow.examples import __all__  # noqa: F401
