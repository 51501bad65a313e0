"""IQuest LoopCoder. Importing this package registers `iquestloopcoder` with transformers' Auto classes."""

from .config import IQuestLoopCoderConfig
from .hf_model import (
    IQuestLoopCoderCache,
    IQuestLoopCoderForCausalLM,
    IQuestLoopCoderModel,
    IQuestLoopCoderPreTrainedModel,
)

__all__ = [
    "IQuestLoopCoderCache",
    "IQuestLoopCoderConfig",
    "IQuestLoopCoderForCausalLM",
    "IQuestLoopCoderModel",
    "IQuestLoopCoderPreTrainedModel",
]
