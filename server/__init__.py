"""The on-board OpenAI-compatible server: the HTTP app and its OpenAI schema over the engine core."""
