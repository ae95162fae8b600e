"""Dialogue backends beyond the reference engine (TensorRT-LLM, ONNX Runtime) and the choice of one for a folder."""
