"""The daemon process: argv and signals (``main``), wiring (``wiring``), systemd notify.

``wiring.run`` builds every part, starts each worker with its stop registered
at once on an ExitStack, and runs the loop that serves and registers with
kubelet. What it must not do: hold logic of its own that a lower package
could own; be imported by anything but the console script and tests.
"""
