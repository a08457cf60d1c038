"""Deciding when to save: the interval that wastes the least, from what the manager
measures (issue 40). Its modules are described in docs/architecture.md."""
