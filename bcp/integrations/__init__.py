"""bcp inside training frameworks: each module plugs bcp into one framework's own
checkpointing, and imports that framework, so none is imported by ``import bcp`` or
by this package (import the module you use; a missing framework names its extra).

One module per framework: Lightning, Accelerate, Hugging Face Transformers, and
PyTorch DCP's storage interface.

docs/integrations.md says what each saves, and how it differs from the framework's own;
docs/architecture.md is the map of the modules.
"""
