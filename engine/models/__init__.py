"""Model families, one file each under engine/models/families/ (each declares a FAMILY:
engine/models/family.py), built on the neutral decoder (decoder.py); registry.py finds them. Kept
free of imports so that configs can reach the registry without building a model."""
