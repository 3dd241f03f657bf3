"""The guest side and the channel to it: the wire protocol, the agent that runs in the guest, the host's client.

``agent.py`` runs inside the VM (plain Python, standard library only) and
``wire.py`` is shared by both ends; ``client.py`` (AgentClient) is the
host's end, ``exec_result.py`` what an exec returns. All of it runs without
a VM, over a socketpair, which is how the unit tests drive it.

Layer 1 of docs/ARCHITECTURE.md, beside image. May import: the foundation
(errors, paths, private, processes, sizes, tables, version, waiting) (the
agent and wire modules: nothing outside the standard library). Never engine or
anything above (checked by tests/unit/test_layers.py).
"""
