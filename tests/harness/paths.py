"""Where things are in the checkout, for tests and benchmarks."""

from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
MPS_STANDIN = str(Path(__file__).resolve().parent / "fakes" / "nvidia-cuda-mps-control")
