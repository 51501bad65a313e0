"""Configuration of IQuest LoopCoder (`model_type="iquestloopcoder"`), with the official config.json field names."""

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig


@strict
class IQuestLoopCoderConfig(PretrainedConfig):
    """A Llama configuration plus the two loop fields.

    `loop_num` is how many times the same `num_hidden_layers` physical layers run (1 = plain Llama, 2 = LoopCoder);
    `loop_window_size` is the number of keys, the query's own position included, seen by the local attention of the
    second loop.

    RoPE: transformers 5.x rotary utilities read `rope_parameters` (`{"rope_type", "rope_theta", ...}`), while the
    official config.json has `rope_theta` and `rope_scaling`. Both are accepted: an official `rope_scaling` dict
    becomes `rope_parameters`, and `rope_theta` is kept as a field (and written to config.json) in sync with
    `rope_parameters["rope_theta"]`.
    """

    model_type = "iquestloopcoder"

    vocab_size: int = 76800
    hidden_size: int = 5120
    intermediate_size: int = 27648
    num_hidden_layers: int = 80
    num_attention_heads: int = 40
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    rope_theta: float | int = 500000.0
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    loop_num: int = 2
    loop_window_size: int = 64
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.loop_num not in (1, 2):
            raise ValueError(
                f"loop_num={self.loop_num} is not supported: only 1 (plain Llama) and 2 (the released LoopCoder) "
                "have a defined meaning."
            )
        if self.loop_window_size < 1:
            raise ValueError(f"loop_window_size must be >= 1, got {self.loop_window_size}.")
        # Turns an official `rope_scaling` kwarg and `rope_theta` into `rope_parameters`.
        super().__post_init__(**kwargs)
        self.rope_theta = self.rope_parameters["rope_theta"]


__all__ = ["IQuestLoopCoderConfig"]


PIPELINE_REFUSAL = ("LoopCoder: pipeline parallel size {pp} is refused: loop 2 of layer l reads loop 1's keys and "
                    "values of layer l, so every stage would run twice per micro-batch (as two virtual stages of "
                    "Megatron's interleaved schedule that share one set of weights, which its DDP and checkpoints "
                    "cannot hold) and keep its layers' loop-1 K/V of every micro-batch in flight in between "
                    "(docs/loopcoder.md, \"Pipeline stages\")")
