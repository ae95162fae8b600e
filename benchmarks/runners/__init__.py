"""The systems a benchmark runs side by side: ours (reference, ONNX Runtime) and the peers."""
