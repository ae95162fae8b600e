"""What CabinLLM reads and writes on disk: checkpoints, engine and graph folders, scales files, weight formats,
chat scripts, and the atomic writes they share."""
