"""CPU backend: torch.compile(dynamic=False) capture, torch attention."""
