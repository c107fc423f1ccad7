"""Configuration: what gpushare-node is told, validated once, passed explicitly.

- ``schema``: the documented, frozen dataclasses (one per YAML section), number ranges;
- ``loading``: reading the YAML file and validating every key, with errors
  that name the dotted key, what was found and what is allowed;
- ``values``: the checks of single values, each given the dotted key;
- ``reload``: which keys a SIGHUP applies to a running daemon.

What it must not do: import anything of nodemgr but ``nodemgr.errors``; keep
global state; touch anything but the config file, ``$NODE_NAME`` and the
hostname.
"""
