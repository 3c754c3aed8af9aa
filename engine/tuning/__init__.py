"""Capture-size tuning (`engine tune-capture`): which decode sizes and extend buckets to capture for a
traffic distribution, measured with the engine's own runners. The application layer: nothing below imports it."""
