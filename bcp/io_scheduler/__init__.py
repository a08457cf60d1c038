"""The I/O scheduler: how tensor bytes move between memory and storage.

Saving cuts each rank's boxes into chunks, stages them through bounded host memory
and streams them to its data file with checksums; loading turns wanted boxes into
coalesced byte ranges and reads them straight into destination memory, verified as
they land. Part of the engine: it works on the engine's plans and pieces. Its modules,
one line each: docs/architecture.md.
"""
