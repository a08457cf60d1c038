"""Conversion between bcp and the formats people use: the machinery behind
:mod:`bcp.convert`, which is the public face (import the functions from there).

One module per job, none importing another's private names, no cycle:

* :mod:`~bcp.interop.formats`: the file names that identify each format, and
  :func:`~bcp.interop.formats.detect_format`.
* :mod:`~bcp.interop.selection`: which keys an export takes, under which names
  (prefix, rename rules), in which dtype, in which batches.
* :mod:`~bcp.interop.files`: writing local output files (publish with the umask's
  mode, stale files of an earlier export, file-backed scratch tensors).
* :mod:`~bcp.interop.per_rank`: per-rank objects in exports (``__rank_<r>__`` keys).
* :mod:`~bcp.interop.safetensors`, :mod:`~bcp.interop.torch_save`,
  :mod:`~bcp.interop.dcp`: each format, both directions.
* :mod:`~bcp.interop.dcp_metadata`: reading DCP's pickled ``.metadata`` without
  running code chosen by its author; :mod:`~bcp.interop.dcp_writer`: DCP's planner
  and writer, streamed in batches. Both import ``torch.distributed.checkpoint`` at
  once, so :mod:`~bcp.interop.dcp` imports them only when a DCP conversion runs.
"""
