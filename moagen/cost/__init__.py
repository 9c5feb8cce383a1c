"""The cost model: a kernel variant's flops F, memory traffic M, scratch and atomic updates,
derived by walking the ONF it emits (model.predict), and their measured counterparts:
cachegrind on the C kernel (measure) and ptxas / SASS of the CUDA kernels (sass)."""
from moagen.cost.model import Cost, SizeError, predict, value  # noqa: F401
