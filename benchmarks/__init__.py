"""Measurements beside the peers (cabin-bench) and the studies behind the figures in the docs."""
