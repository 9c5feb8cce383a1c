"""The CUDA mapping steps of a tiled kernel: a thread block per output tile (BlockTiles),
the block's threads over its rows and columns, each a register tile (ThreadTiles), operand
tiles staged through shared memory (Stage), a block's scratch in shared memory
(SharedScratch) and an output tile in registers (RegisterTile); as realize closes the ONF
(closing), the block form is checked, the shared memory laid out, and the barriers and the
warp reductions put in as statements, which the printer (moagen.targets.cuda.tiled) only
prints; the CUDA emulation's race check verifies them.

A local defined inside thread loops is one value per iteration of those loops: each
thread's register tile. The same thread loops elsewhere in the nest (the same variable and
range) see the same values, as one thread runs all of them. The ONF interpreter does not
model that; these nests are verified by the CUDA emulation."""
