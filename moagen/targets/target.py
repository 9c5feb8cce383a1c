"""What a language is to moagen: how a kernel is printed in it, built, loaded and bound."""
from dataclasses import dataclass
from typing import Callable, Optional


def _anywhere() -> bool:
    return True


@dataclass(frozen=True)
class Target:
    name: str  # the language's name on the command line (--lang) and in results
    extension: str  # of its sources in generated/
    kind: str  # the mapping kind it is printed from: moagen.kinds.KINDS
    emit: Callable  # (pairs of dtype and final ONF, banner lines) -> source text
    build: Callable  # (source, stem, toolchain=None) -> the built artifact (moagen.targets.<lang>.build)
    load: Callable  # (artifact) -> the library `bind` takes (moagen.targets.<lang>.loader.load)
    bind: Callable  # (library, signature, validate=None) -> KernelCallable
    toolchain: str  # its compiler's record in moagen.targets.toolchain.Toolchain.describe()
    # whether its kernels can run on this machine (they build on any), and what is
    # missing where they cannot
    runs_here: Callable[[], bool] = _anywhere
    missing: str = ""
    # what `moagen build` does instead of building and loading the library, where the
    # code is meant for other machines too: (source, stem) -> lines to print
    compile_only: Optional[Callable] = None
    # the language this one prints differently for an experiment; it has no sources in
    # generated/ and is no language of `moagen generate`, `build` and `verify` by default
    variant_of: Optional[str] = None
    # whether its times say something about the machine it is meant for (an emulation's
    # do not): the bench refuses to measure it otherwise
    measured: bool = True
    # where its kernels run when that is not the host: () -> the device, which holds their
    # arrays and times them (moagen.targets.cuda.driver.Driver); None for host code
    device: Optional[Callable] = None

    def library(self, source: str, stem: str, toolchain=None):
        """Build `source` (cached) and load it."""
        return self.load(self.build(source, stem, toolchain))
