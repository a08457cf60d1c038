"""How ranks agree: bcp's own gloo groups and lanes, the collectives every save and load
runs in named phases, the network they use, and the priority of background threads.
Its modules, one line each: docs/architecture.md."""
