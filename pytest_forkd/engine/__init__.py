"""The engine layer: virtual machines as processes, their memory, their run directory.

:mod:`.base` is the interface the layers above use (``Engine``, ``Machine``,
``Capabilities``); :mod:`.qemu` is its real implementation and :mod:`.fake`
a VMM-less one for fast tests. Only ``engine/qemu/`` knows QEMU's command
line and QMP. :mod:`.network` is the guest network policy, :mod:`.memory`
guest memory seen from the VMM's side.

Layer 2 of docs/ARCHITECTURE.md. May import: the foundation (errors, paths,
private, processes, sizes, tables, version, waiting), guest and image (the
QEMU engine resolves and builds the guest images it boots). Never storage,
latency, core or anything above (checked by tests/unit/test_layers.py).
"""
