"""hf_speedup: the right accelerations for Hugging Face fine-tuning, wired in and verified."""

from .config import SpeedupConfig, SpeedupConfigError
from .estimate import estimate_memory, longest_sequence
from .features.interrupt import TrainingInterrupted
from .features.memory import enable_expandable_segments, memory_env
from .loading import load_model, load_tokenizer
from .plan import build_plan, plan_for
from .presets import get_preset, list_presets
from .stock import sft_config, training_arguments
from .trainer import SpeedupMixin, SpeedupTrainer

__all__ = [
    "SpeedupTrainer",
    "SpeedupMixin",
    "SpeedupConfig",
    "SpeedupConfigError",
    "get_preset",
    "list_presets",
    "training_arguments",
    "sft_config",
    "build_plan",
    "plan_for",
    "estimate_memory",
    "longest_sequence",
    "load_model",
    "load_tokenizer",
    "memory_env",
    "enable_expandable_segments",
    "TrainingInterrupted",
]
from ._version import __version__  # noqa: F401


def __getattr__(name: str):
    """``SpeedupSFTTrainer`` imports TRL, so only on first use (and only where TRL is installed)."""
    if name == "SpeedupSFTTrainer":
        try:
            from .trl_support import SpeedupSFTTrainer
        except ImportError as exc:
            raise ImportError("hf_speedup.SpeedupSFTTrainer needs TRL: pip install 'hf_speedup[trl]' "
                              f"(trl==1.16.0, the release tested); import failed: {exc}") from exc
        return SpeedupSFTTrainer
    raise AttributeError(f"module 'hf_speedup' has no attribute {name!r}")
