"""hf_speedup: the right accelerations for Hugging Face fine-tuning, wired in and verified."""

from .config import SpeedupConfig, SpeedupConfigError
from .features.memory import enable_expandable_segments, memory_env
from .loading import load_model, load_tokenizer
from .plan import build_plan
from .presets import get_preset, list_presets
from .stock import training_arguments
from .trainer import SpeedupMixin, SpeedupTrainer

__all__ = [
    "SpeedupTrainer",
    "SpeedupMixin",
    "SpeedupConfig",
    "SpeedupConfigError",
    "get_preset",
    "list_presets",
    "training_arguments",
    "build_plan",
    "load_model",
    "load_tokenizer",
    "memory_env",
    "enable_expandable_segments",
]
from ._version import __version__  # noqa: F401
