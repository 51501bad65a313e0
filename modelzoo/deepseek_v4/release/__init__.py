"""DeepSeek-V4's release checkpoint format: native tensor names, FP8 block-scaled and MXFP4 weights.

    checkpoint.py     the names (native <-> HF), which weights the release quantises, load and save
    view.py           a CheckpointReader-shaped view that renames and dequantises on read; kept source scales
    quantization.py   the FP8 block and MXFP4 formats: dequantise and quantise
"""
