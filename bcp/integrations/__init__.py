"""Integrations of bcp with training frameworks and their checkpointing (docs/integrations.md)."""
