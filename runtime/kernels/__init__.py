"""Native decode kernels: the C sources beside this file, and their build, load and call (``bindings``)."""
