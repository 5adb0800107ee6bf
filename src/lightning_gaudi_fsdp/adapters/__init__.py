"""The only modules that may use torch's and Lightning's private names (with :mod:`lightning_gaudi_fsdp._compat`,
which owns every difference between supported versions).

- :mod:`.fsdp1_internals`: FSDP1's flat-parameter internals (``_handle``, ``_fqns``, ``_shard_param_infos``...), its
  private wrap-policy class and name cleaning, behind :class:`~.fsdp1_internals.UnitView`.
- :mod:`.torch_internals`: torch's serialization, distributed-checkpoint, ``ShardedTensor``/``DTensor`` and
  ``nn.Module`` internals (the streaming zip writer, safe unpickling, DCP planners and offline reads).
- :mod:`.lightning_internals`: Lightning's private helpers and call-stack facts (the checkpoint connector, the
  ``weights_only`` of ``Trainer._run``, forward redirection, strict-key validation).

Each fact is a small named function or view; ``tests/test_adapters.py`` checks every upstream name they rely on, so
a torch or Lightning release that moves one fails there, loudly, rather than switching a feature off.
"""
