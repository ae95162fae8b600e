"""The engine: a loaded model (``loader``) and the core that runs requests on it (``core``, ``scheduler``, ``request``)."""
