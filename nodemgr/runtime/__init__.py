"""The daemon process: argv and signals, wiring, the run loop, systemd notify.

- ``main``: the command line, logging and signals;
- ``fdlimit``: the open-file limit, raised and checked against the budget;
- ``wiring``: every part built and started in order, each start followed by its stop;
- ``loop``: serve kubelet, register, watch, reconcile, reload, tell systemd;
- ``notify``: the systemd service protocol.

``wiring.run`` builds every part, starts each worker with its stop registered
at once on an ExitStack, and runs the loop that serves and registers with
kubelet. What it must not do: hold logic of its own that a lower package
could own; be imported by anything but the console script and tests.
"""
