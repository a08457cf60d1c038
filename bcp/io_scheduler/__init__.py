"""The I/O scheduler: how tensor bytes move between memory and storage.

Saving: ``write_pipeline`` cuts each rank's boxes into chunks, stages them through
the bounded pinned-memory pool of ``staging`` (device copies ordered by
``device_copy``) and streams them to the data file with checksums. Loading:
``read_plan`` turns wanted boxes into coalesced byte ranges, ``read_exec`` runs
them with bounded concurrency and verification, ``device_load`` lands them on a
device through pinned slabs, and ``shared_read`` lets one rank read a range for
all ranks that need it.
"""
