"""CUDA: the printer, the builds (nvcc for a GPU; g++ for the host emulation), the loader
with its device arrays and driver, the emulation, and the file skeleton; target.py
registers them."""
