"""The hostile-tenant table (issue 14): every attack of the issue, and a few more, made by a
tenant against the real daemon, the test kubelet, real runc containers and NVIDIA's real MPS
control binary. attacks.py holds what the attacks do, tenant.py the node the cases share and
how an outcome becomes the words of a row; test_hostile_tenant.py runs them and generates the
README table "Attacks tried, and what they got" from what it observed."""
