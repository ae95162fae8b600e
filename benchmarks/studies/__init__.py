"""One-off measurements behind figures in the docs, each a ``python -m`` command."""
