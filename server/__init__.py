"""The on-board OpenAI-compatible server: the HTTP app, its OpenAI schema, the continuous-batching scheduler."""
