"""Model families, one file each (engine/models/families.py lists them; registry.py maps checkpoints
to them). Kept free of imports so that configs can reach the registry without building a model."""
