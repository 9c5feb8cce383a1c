"""CUDA: built with nvcc into a library of host launchers, run on the GPU's memory through
cuda-python where there is a GPU; compiled for every GPU we target on any machine. And the
same source run on the host, each block's threads an OpenMP team, so that CUDA is verified
on every machine."""
from moagen.targets.cuda import driver, emulated, loader
from moagen.targets.cuda.build import CUDA_ARCHS, build_cuda, build_cuda_emulated, compile_cuda
from moagen.targets.cuda.printer import emit_cuda
from moagen.targets.target import Target


def compile_for_gpus(source, stem):
    """A cubin per GPU we target (CUDA_ARCHS), whether one is here or not."""
    for arch in CUDA_ARCHS:
        result = compile_cuda(source, stem, arch)
        yield f"compiled {stem}.cu for {arch}: {result.cubin}"


TARGET = Target("cuda", extension="cu", kind="cuda", emit=emit_cuda, build=build_cuda,
                load=loader.load, bind=loader.bind, toolchain="cuda",
                runs_here=loader.available, missing="no GPU (or no cuda-python)",
                compile_only=compile_for_gpus, device=driver.device)

# the same source, built and bound for the host; verified by `moagen verify --emulate`
EMULATED = Target("cuda-emulated", extension="cu", kind="cuda", emit=emit_cuda,
                  build=build_cuda_emulated, load=emulated.load,
                  bind=emulated.bind, toolchain="cuda-emulated", variant_of="cuda",
                  measured=False, device=emulated.device)
