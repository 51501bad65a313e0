"""DeepSeek-V4.1: the HF config and our reference text model. Importing this package registers `deepseek_v41`
with transformers' Auto classes when the installed transformers has none of its own."""

from .config import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from .hf_model import DeepseekV41ForCausalLM, DeepseekV41TextModel, build_engram_token_map

__all__ = ["DeepseekV41Config", "DeepseekV41ForCausalLM", "DeepseekV41TextConfig", "DeepseekV41TextModel",
           "DeepseekV41VisionConfig", "build_engram_token_map"]
