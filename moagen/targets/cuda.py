"""CUDA: built with nvcc into a library of host launchers, run on the GPU's memory through
cuda-python where there is a GPU; compiled for every GPU we target on any machine. And the
same source run on the host, each block's threads an OpenMP team, so that CUDA is verified
on every machine."""
from moagen import build
from moagen.bind import cuda as loader
from moagen.bind import cuda_driver, cuda_emulated
from moagen.codegen.cuda import emit_cuda
from moagen.targets.target import Target


def compile_for_gpus(source, stem):
    """A cubin per GPU we target (moagen.build.CUDA_ARCHS), whether one is here or not."""
    for arch in build.CUDA_ARCHS:
        result = build.compile_cuda(source, stem, arch)
        yield f"compiled {stem}.cu for {arch}: {result.cubin}"


TARGET = Target("cuda", extension="cu", kind="cuda", emit=emit_cuda, build=build.build_cuda,
                load=loader.load, bind=loader.bind, toolchain="cuda",
                runs_here=loader.available, missing="no GPU (or no cuda-python)",
                compile_only=compile_for_gpus, device=cuda_driver.device)

# the same source, built and bound for the host; verified by `moagen verify --emulate`
EMULATED = Target("cuda-emulated", extension="cu", kind="cuda", emit=emit_cuda,
                  build=build.build_cuda_emulated, load=cuda_emulated.load,
                  bind=cuda_emulated.bind, toolchain="cuda-emulated", variant_of="cuda",
                  measured=False, device=cuda_emulated.device)
