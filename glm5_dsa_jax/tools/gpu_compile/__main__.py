"""``python -m glm5_dsa_jax.tools.gpu_compile``: an alias of ``glm5-dsa gpu-compile`` (the compile
table, see the package doc), kept because ``compile_cases`` starts its per-target worker
process with it (``--worker``) and the README and CI call it. It sits with the command line
in the import order (``tests/test_structure.py``)."""

import sys

from glm5_dsa_jax.cli import main

sys.exit(main(["gpu-compile", *sys.argv[1:]]))
