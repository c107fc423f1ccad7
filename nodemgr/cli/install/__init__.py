"""``nodemgr install`` / ``uninstall``: systemd units, tmpfiles, hooks and config.

``templates/`` holds the Jinja2 sources. What it must not do: overwrite an
edited config or remove a file the operator changed (a hash manifest says
which files are still as installed).
"""
