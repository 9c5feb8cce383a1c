"""The schedule steps, each a function from one ONF to the next: step.py the contract they
all follow, loop/ the generic loop transformations and mappings (and the closing steps
every ONF ends with), algebra/ the steps that work on what the loops compute (an online
softmax, a sum cut into parts or slices, the keys of a score row, a causal mask)."""
