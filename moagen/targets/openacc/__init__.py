"""OpenACC C and Fortran: the CPU printers with their parallel loops as OpenACC compute
constructs, gcc's nvptx offloading and its device code; target.py registers them."""
