"""``python -m glm5_dsa_jax.gpu_compile``: the compile table (see the package doc), and the
per-target worker process that ``compile_cases`` starts (``--worker``)."""

import sys

from glm5_dsa_jax.gpu_compile import main

sys.exit(main())
