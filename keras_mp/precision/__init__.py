"""Per-layer precision choice (INT8 / FP8 / FP16) for TensorRT GPUs."""
