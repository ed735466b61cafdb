"""Memory estimates of a training layout (docs/memory.md)."""
