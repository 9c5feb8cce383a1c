"""The error types moagen raises. Each says what went wrong in terms the user can act on."""


class MoagenError(Exception):
    """Base class of every error moagen raises on purpose."""


class SpecError(MoagenError):
    """A malformed MoA specification (wrong node arguments, unknown operator)."""


class ShapeError(SpecError):
    """Shapes that do not fit together; the message names the node path and the shapes."""


class ScheduleError(MoagenError):
    """A schedule transformation that cannot be honoured on the loop nest it is given."""


class UnknownNameError(MoagenError, KeyError):
    """An unknown kernel, variant, language or dtype."""

    def __str__(self):  # KeyError would print the message with quotes around it
        return str(self.args[0])


class CompilerNotFound(MoagenError):
    """A compiler or tool that is not installed; the message names the package to install."""


class CompileError(MoagenError):
    """A failed compile; the message shows the command, the source path and the output."""


class DeviceUnavailable(MoagenError):
    """A CUDA kernel was asked to run where there is no cuda-python or no GPU."""


class EmulationCheckError(MoagenError, RuntimeError):
    """A CUDA launch the host emulation's checks failed: a race on shared memory or an index
    out of bounds (the race check), a shuffle it cannot run; the message names the kernel,
    the array or call, and the threads."""


class SharedMemoryLimit(MoagenError, RuntimeError):
    """A tiled CUDA kernel whose block asks more dynamic shared memory than the device allows
    a block; the message names the kernel's instance, the bytes and the device's limit."""
