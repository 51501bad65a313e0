"""Optional integrations with downstream trainers' libraries; the core package imports none of them.

`megatron_bridge`: registers our architectures with Megatron-Bridge's AutoBridge (extra `megatron-bridge`,
environment from .ci/setup_megatron_bridge).
"""
