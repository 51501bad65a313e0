"""modelzoo.cuda_graphs on CPU: what it refuses (its replay is tested on the GPU in tests/deepseek_v4/test_cuda_graphs_gpu.py)."""

import pytest
import torch

from modelzoo.cuda_graphs import LayerGraphs


def test_capture_of_cpu_tensors_is_refused_with_the_device_named():
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors: the sample inputs are on cpu"):
        LayerGraphs([torch.nn.Linear(4, 4)], torch.zeros(2, 4))
