"""Model registry: name -> (model class, flavors)."""

from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model

MODELS = {"qwen3": (Qwen3Model, qwen3_flavors)}

__all__ = ["MODELS", "Qwen3Model", "Qwen3ModelArgs", "qwen3_flavors"]
