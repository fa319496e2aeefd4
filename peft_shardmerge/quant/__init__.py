"""Quantized weights: bitsandbytes 4-bit and 8-bit, fine-grained FP8 and MXFP4, exact dequantization."""
