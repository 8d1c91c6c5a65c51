"""``python -m glm5_dsa_jax.cli``: the same as the ``glm5-dsa`` command."""

import sys

from glm5_dsa_jax.cli import main

sys.exit(main())
