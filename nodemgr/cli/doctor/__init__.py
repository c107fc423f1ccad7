"""``nodemgr doctor``: checks of a node, each a PASS, WARN or FAIL with a precise fix.

What it must not do: change anything on the node (its hook probe leaves the
hook server as it found it).
"""
