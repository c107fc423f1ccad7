"""The fault matrix: each fault against the real daemon, the test kubelet and
real runc, then the same checks after every one of them (survival.py). The faults
themselves are made by injectors.py; test_fault_matrix.py runs them and generates the
table of docs/faults.md from what it observed."""
