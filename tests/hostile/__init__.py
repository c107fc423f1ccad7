"""The hostile-tenant table: every attack a tenant is known to try, made by a
tenant against the real daemon, the test kubelet, real runc containers and NVIDIA's real MPS
control binary. attacks.py holds what the attacks do, tenant.py the node the cases share and
how an outcome becomes the words of a row; test_hostile_tenant.py runs them and generates the
table "Tenant attacks" of docs/attacks.md from what it observed."""
