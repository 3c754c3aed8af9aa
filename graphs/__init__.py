"""Graph runners: capture the decode step once per batch size, replay with padding."""
