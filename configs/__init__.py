"""Per-device default settings (YAML) and model presets for --load-format dummy."""
