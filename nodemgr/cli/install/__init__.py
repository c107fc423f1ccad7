"""``nodemgr install`` / ``uninstall``: systemd units, tmpfiles, hooks and config.

- ``command``: the command line and its exit statuses;
- ``render``: Target, FileSpec, the Jinja2 environment and its quoting filters, the
  default config, the console scripts, the source tree's shipped copies;
- ``apply``: install and uninstall under a root: plan, write, printed next steps;
- ``files``: node paths under the root, atomic writes, the manifest;
- ``scheduler``: ``nodemgr install --scheduler``, the gpushare-scheduler unit for a
  control-plane node.

``templates/`` holds the Jinja2 sources.

What it must not do: overwrite an edited config or remove a file the operator
changed (a hash manifest says which files are still as installed); run
systemctl or change the running system; import a sibling command package.
"""
