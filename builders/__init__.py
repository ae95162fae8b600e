"""Builders: target profiles, the memory planner, TensorRT-LLM checkpoints and trtllm-build, ONNX graphs for NPUs."""
