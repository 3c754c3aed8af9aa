"""One module per model family, each defining `FAMILY` (engine/models/family.py). The registry
(engine/models/registry.py) imports every module here: adding a family is adding a file. Nothing is
imported by this package itself, so that reaching the registry builds no model code."""
