"""``pytest --forkd-isolate``: an existing suite, each test in a child VM of a parent that collected it.

``options`` (its options, ini keys and marker), ``hooks`` (which tests, each
test's protocol), ``plan`` (what goes into the guest and how its pytest
starts), ``forwarding`` (the host's parsed options, plugins and environment
the guest's pytest gets), ``imports`` (where the host takes the project's
code from), ``parent`` (the parent VM, its branches, a child per test) and
``reports`` (the guest's reports read back, and those made when a child
died). The pytest process inside the guest is
:mod:`pytest_forkd.guest.isolate_runner` with its siblings
``isolate_plugin``, ``isolate_imports`` and ``isolate_pytest`` (the one door
to pytest's private internals, which the host's side uses too), beside the
agent: plain Python that imports nothing of the package. The plugin
(:mod:`pytest_forkd.plugin`) registers the options and hands selected tests
to the hooks here.

Layer 7 of docs/ARCHITECTURE.md. May import every layer below and the
plugin's own modules. Nothing below imports it.
"""
